"""A node keeps its identity across deploys (issue 28). With `user_data_causes_replacement` CDK appends a
hash of the user data to each instance's logical ID, and CloudFormation replaces an instance whose user
data changes: on Spot, the replaced node's persistent request then relaunches an orphan. So user data
holds only what a node keeps for its life; adding a node, a new base image and an edit of the bootstrap
script reach the node-config parameter (and the script's own asset), and node0/node1 stay."""

import json
import re

from aws_cdk.assertions import Template
from conftest import cdk_app

from cluster_node.protocol.contract import node_config_parameter
from stacks import bootstrap
from stacks.cluster_stack import GpuClusterStack
from stacks.pins import synth_config
from stacks.userdata import USER_DATA_KEYS

PINS = {"availability_zone": "us-east-1a", "ami_id": "ami-0123456789abcdef0", "ssh_cidr": "203.0.113.0/24"}
STUB_BUDGET = 4 * 1024  # bytes: a stub, far under EC2's 16 KB


def _template(**context) -> dict:
    config = synth_config({**PINS, **context}, region=None)
    return Template.from_stack(GpuClusterStack(cdk_app(), "Cluster", config=config)).to_json()


def _nodes(template: dict) -> dict[int, tuple[str, str]]:
    """rank -> (logical ID, user data as JSON)."""
    nodes = {}
    for logical_id, resource in template["Resources"].items():
        if resource["Type"] == "AWS::EC2::Instance":
            tags = {t["Key"]: t["Value"] for t in resource["Properties"]["Tags"]}
            nodes[int(tags["gpu-cluster:rank"])] = (logical_id, json.dumps(resource["Properties"]["UserData"]))
    return nodes


def _node_config(template: dict) -> str:
    (value,) = [
        json.dumps(r["Properties"]["Value"])
        for r in template["Resources"].values()
        if r["Type"] == "AWS::SSM::Parameter" and r["Properties"]["Name"] == node_config_parameter("gpu-cluster")
    ]
    return value


def test_node0_and_node1_keep_their_logical_ids_when_a_third_node_is_added():
    two, three = _nodes(_template(nodes="2")), _nodes(_template(nodes="3"))
    assert [two[0], two[1]] == [three[0], three[1]] and len(three) == 3


def test_a_new_base_image_replaces_no_node_and_reaches_new_nodes_through_the_node_config():
    before, after = _template(), _template(image="nvcr.io/nvidia/pytorch:25.01-py3")
    assert _nodes(before) == _nodes(after)
    assert "BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3" in _node_config(after)
    assert "25.01" not in _node_config(before)
    assert _image_context(before) != _image_context(after), "a node that runs its stub again must rebuild"


def _image_context(template: dict) -> str:
    (value,) = [
        json.dumps(r["Properties"]["Value"])
        for r in template["Resources"].values()
        if r["Type"] == "AWS::SSM::Parameter" and r["Properties"]["Name"].endswith("/image-context")
    ]
    return value


def test_an_edit_of_the_bootstrap_script_replaces_no_node_and_is_a_new_asset(tmp_path, monkeypatch):
    before = _template()
    edited = tmp_path / "node-bootstrap.sh"
    edited.write_text(bootstrap.BOOTSTRAP_SCRIPT.read_text() + ": an edit\n")
    monkeypatch.setattr(bootstrap, "BOOTSTRAP_SCRIPT", edited)
    after = _template()
    assert _nodes(before) == _nodes(after)
    assert _node_config(before) != _node_config(after), "new nodes must fetch the edited script"


def test_user_data_is_a_stub_with_life_long_values_only_under_4_kb_at_the_longest():
    template = _template(cluster_name="c" * 31, image="nvcr.io/" + "n" * 200 + ":" + "t" * 40, nodes="64", spot="true")
    sizes = []
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::EC2::Instance":
            user_data = resource["Properties"]["UserData"]
            sizes.append(bootstrap.check_user_data_size(user_data, "node"))
            text = "".join(p if isinstance(p, str) else "<token>" for p in user_data["Fn::Base64"]["Fn::Join"][1])
            keys = re.findall(
                r"^([A-Z_]+)=", text.split("<<'GPU_CLUSTER_ENV'\n", 1)[1].split("\nGPU_CLUSTER_ENV")[0], re.M
            )
            assert tuple(keys) == USER_DATA_KEYS  # each a life-long value: one more replaces every node
    print(f"user data: {max(sizes)} bytes at most, tokens at {bootstrap.TOKEN_ALLOWANCE} bytes each")
    assert max(sizes) < STUB_BUDGET


def test_the_node_role_may_read_the_node_config_parameter_and_the_script_object_and_no_other():
    template = _template()
    statements = [
        s
        for r in template["Resources"].values()
        if r["Type"] == "AWS::IAM::Policy" and "GpuNodesNodeRole" in json.dumps(r["Properties"]["Roles"])
        for s in r["Properties"]["PolicyDocument"]["Statement"]
    ]
    reads = [json.dumps(s["Resource"]) for s in statements if "ssm:GetParameter" in json.dumps(s["Action"])]
    (config_id,) = [
        k
        for k, r in template["Resources"].items()
        if r["Properties"].get("Name") == node_config_parameter("gpu-cluster")
    ]
    assert sum(f'{{"Ref": "{config_id}"}}' in r for r in reads) == 1
    assert not any("*" in r for r in reads), reads
    objects = [json.dumps(s["Resource"]) for s in statements if "s3:GetObject" in json.dumps(s["Action"])]
    assert any(".sh" in o for o in objects), objects
    assert not any("*" in o for o in objects), objects  # objects by key: no bucket-wide read


def test_a_new_instance_type_replaces_each_node_instead_of_stopping_them_all():
    """AWS::EC2::Instance InstanceType: "Update requires: Some interruptions" (CloudFormation stops every node
    at once, changes the type, starts it), and "While a Spot Instance is stopped, you can modify some of its
    instance attributes, but not the instance type" (EC2 User Guide, Spot interruption behavior): a Spot
    cluster's type change failed and rolled back. The type is in user data, so each node is a new resource."""
    for spot in ("false", "true"):
        before, after = _template(spot=spot), _template(spot=spot, instance_type="g5.2xlarge")
        old, new = _nodes(before), _nodes(after)
        assert set(old) == set(new) == {0, 1}
        assert all(old[rank][0] != new[rank][0] for rank in old), spot  # new logical IDs: replacement
        assert all("INSTANCE_TYPE=g5.2xlarge" in new[rank][1] for rank in new)


def test_a_new_instance_type_gets_a_new_placement_group_beside_the_old_one():
    """The replacing nodes start a cluster placement group of their own (EC2 User Guide, placement group rules:
    launch a group's instances at once; joining the old nodes' hardware is likelier to lack capacity)."""

    def groups(template: dict) -> list[str]:
        return [k for k, r in template["Resources"].items() if r["Type"] == "AWS::EC2::PlacementGroup"]

    before, after = groups(_template()), groups(_template(instance_type="g5.2xlarge"))
    assert len(before) == len(after) == 1 and before != after
    assert groups(_template(nodes="3")) == before  # a node more joins the group
