"""Which types `efa=auto` turns EFA on for (stacks/instance_types.py's `gpudirect_rdma`, read by
stacks/config.py), what `efa=on` still allows, and the template each gives: one EFA per network card in
each node's launch template, the node group open to itself, Spot's market options alongside."""

import pytest
from aws_cdk.assertions import Match, Template
from stack_templates import cluster_template, launch_templates

from stacks.config import ClusterConfig
from stacks.instance_types import INSTANCE_TYPES

SSM_PRIVATE = {"access": "ssm", "private_subnet": "true"}
SSH = {"ssh_cidr": "203.0.113.7/32"}


@pytest.mark.parametrize(
    "instance_type, context, cards",
    [
        ("p4d.24xlarge", SSM_PRIVATE, 4),
        ("p4de.24xlarge", SSM_PRIVATE, 4),
        ("p5.48xlarge", SSM_PRIVATE, 32),
        ("g4dn.12xlarge", {}, 0),
        ("g5.12xlarge", {}, 0),
        ("g6.48xlarge", {}, 0),
        ("g6e.48xlarge", SSM_PRIVATE, 0),
        ("p3dn.24xlarge", {}, 0),
    ],
)
def test_efa_auto_is_on_only_where_the_gpus_and_efa_do_gpudirect_rdma(instance_type, context, cards):
    """Only P4d, P4de and P5 pair EFA with GPUDirect RDMA (aws/aws-ofi-nccl#547, bwbarrett, Aug 2025:
    "the only instance types in EC2 that support GPUDirect RDMA are the P-series starting with p4d";
    aws-ofi-nccl doc/efa-env-var.md: "only p4 and p5 instances support both EFA and ... GPUDirect RDMA").
    Elsewhere aws-ofi-nccl falls back to its send/recv protocol through host bounce buffers
    (doc/plugin-initialization.md), a path AWS does not test on g-types (the plugin's v1.7.3-aws notes:
    "tested on P3dn, P4d/P4de, and P5"): auto leaves it off, `efa=on` still turns it on."""
    config = ClusterConfig.from_context({"instance_type": instance_type, **(context or SSH)})
    assert config.efa_cards == cards
    if not cards:
        assert "GPUDirect RDMA" in (config.efa_note or "") and "efa=on" in config.efa_note


@pytest.mark.parametrize("instance_type", ["g4dn.12xlarge", "g5.12xlarge", "p3dn.24xlarge"])
def test_efa_on_still_turns_it_on_where_there_is_no_gpudirect_rdma(instance_type):
    config = ClusterConfig.from_context({"instance_type": instance_type, "efa": "on", **SSH})
    assert config.efa_cards == INSTANCE_TYPES[instance_type].efa == 1 and config.efa_note is None


def test_the_table_marks_gpudirect_rdma_only_on_p4d_p4de_and_p5():
    marked = {t.family for t in INSTANCE_TYPES.values() if t.gpudirect_rdma}
    assert marked == {"p4d", "p4de", "p5"}
    assert all(t.efa for t in INSTANCE_TYPES.values() if t.gpudirect_rdma)


# ---------------------------------------------------------------- the template


def _efa_interfaces(template: Template) -> list[list[dict]]:
    return [
        t["Properties"]["LaunchTemplateData"].get("NetworkInterfaces", [])
        for t in template.find_resources("AWS::EC2::LaunchTemplate").values()
    ]


@pytest.mark.parametrize(
    "instance_type, context, cards",
    [
        ("p4d.24xlarge", {"access": "ssm", "private_subnet": "true"}, 4),
        ("p5.48xlarge", {"access": "ssm", "private_subnet": "true"}, 32),
        ("g5.12xlarge", {"efa": "on"}, 1),  # no GPUDirect RDMA: auto leaves EFA off (tests/test_efa.py)
        ("g4dn.2xlarge", {}, 0),
    ],
)
def test_each_node_gets_one_efa_per_card_of_its_type(instance_type, context, cards):
    params = {"ssh_cidr": None} if context.get("access") == "ssm" else {}
    template = cluster_template(instance_type=instance_type, nodes="2", **params, **context)
    per_node = _efa_interfaces(template)
    assert len(per_node) == 2  # one launch template per node (IMDSv2 required in each)
    for interfaces in per_node:
        efa = [i for i in interfaces if i["InterfaceType"] in ("efa", "efa-only")]
        assert len(efa) == cards
        assert sorted({i["NetworkCardIndex"] for i in efa}) == list(range(cards))
        if interfaces:
            primary = [i for i in interfaces if (i["NetworkCardIndex"], i["DeviceIndex"]) == (0, 0)]
            assert len(primary) == 1 and primary[0]["InterfaceType"] in (
                "efa",
                "interface",
            )  # efa-only can't be primary
            assert all(i["Groups"] and i["SubnetId"] for i in interfaces)
            assert (len(interfaces) == 1) == ("AssociatePublicIpAddress" in primary[0])
    for instance in template.find_resources("AWS::EC2::Instance").values():
        assert ("SubnetId" in instance["Properties"]) == (cards == 0)
    template.has_resource_properties(
        "AWS::EC2::LaunchTemplate", {"LaunchTemplateData": {"MetadataOptions": {"HttpTokens": "required"}}}
    )


def test_the_node_group_admits_and_sends_all_traffic_to_itself_for_efa():
    template = cluster_template(instance_type="g5.12xlarge")
    template.has_resource_properties(
        "AWS::EC2::SecurityGroupEgress",
        {"IpProtocol": "-1", "DestinationSecurityGroupId": {"Fn::GetAtt": Match.array_with(["GroupId"])}},
    )


@pytest.mark.parametrize(
    "context, words",
    [
        ({"instance_type": "g4dn.2xlarge", "efa": "on"}, "has no EFA"),
        ({"instance_type": "g5.12xlarge", "efa": "on", "placement_group": "false"}, "one cluster placement group"),
        ({"instance_type": "p5.48xlarge", "efa": "on"}, "no public IP"),
        ({"instance_type": "g5.12xlarge", "efa": "on", "spot": "true"}, "On-Demand nodes .no spot=true. for EFA"),
    ],
)
def test_efa_on_where_it_cannot_work_is_one_line(context, words):
    from stacks.config import ConfigError

    with pytest.raises(ConfigError, match=words) as caught:
        ClusterConfig.from_context(context)
    assert "\n" not in str(caught.value)


def test_spot_nodes_get_no_placement_group_and_so_no_efa():
    """EC2 User Guide, placement group rules: "You can't launch a Spot Instance that is configured to stop or
    hibernate on interruption in a placement group"; these stop. EFA needs the group, so auto leaves it off."""
    template = cluster_template(
        instance_type="p4d.24xlarge", nodes="2", ssh_cidr=None, access="ssm", private_subnet="true", spot="true"
    )
    datas = launch_templates(template)
    assert all(d["InstanceMarketOptions"]["SpotOptions"]["InstanceInterruptionBehavior"] == "stop" for d in datas)
    assert all(d["MetadataOptions"] == {"HttpTokens": "required", "HttpPutResponseHopLimit": 1} for d in datas)
    assert not any(i.get("InterfaceType") for d in datas for i in d.get("NetworkInterfaces", []))
    template.resource_count_is("AWS::EC2::PlacementGroup", 0)
    nodes = template.find_resources("AWS::EC2::Instance")
    assert len(nodes) == 2 and not any("PlacementGroupName" in n["Properties"] for n in nodes.values())
    config = ClusterConfig.from_context({"instance_type": "p4d.24xlarge", "spot": "true", "access": "ssm"})
    assert config.efa_cards == 0 and "Spot nodes have no placement group" in (config.efa_note or "")


def test_spot_with_a_placement_group_asked_for_is_one_line():
    from stacks.config import ConfigError

    with pytest.raises(ConfigError, match="placement group: leave it unset with spot=true") as caught:
        ClusterConfig.from_context({"spot": "true", "placement_group": "true"})
    assert "\n" not in str(caught.value)
    assert ClusterConfig.from_context({"spot": "true", "placement_group": "false"}).in_placement_group is False
    assert ClusterConfig.from_context({}).in_placement_group is True
