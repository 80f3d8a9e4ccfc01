"""Each construct built alone (and the stack composed) for 1, 2 and 8 nodes, asserted with Template + Match."""

import json
import re

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ec2 as ec2
from aws_cdk.assertions import Match, Template
from conftest import REPO, cdk_app
from stack_templates import AMI, SSH_CIDR, cluster_template, launch_templates

from stacks.config import ClusterConfig, offerings_context_key
from stacks.network import ClusterNetwork
from stacks.storage import SharedStorage


def _stack() -> cdk.Stack:
    return cdk.Stack(cdk_app(), "Test")


@pytest.fixture(scope="module", params=[1, 2, 8], ids=lambda n: f"{n}-nodes")
def cluster(request) -> tuple[int, Template]:
    return request.param, cluster_template(nodes=str(request.param))


# ---------------------------------------------------------------- network


def test_network_security_group_allows_all_traffic_only_from_itself_and_ssh_from_cidr():
    stack = _stack()
    network = ClusterNetwork(stack, "Network", ssh_cidr=SSH_CIDR)
    template = Template.from_stack(stack)
    sg_id = stack.resolve(network.security_group.security_group_id)
    template.has_resource_properties(
        "AWS::EC2::SecurityGroupIngress", {"IpProtocol": "-1", "SourceSecurityGroupId": sg_id, "GroupId": sg_id}
    )
    ingress = template.find_resources("AWS::EC2::SecurityGroup")
    rules = [r for res in ingress.values() for r in res["Properties"].get("SecurityGroupIngress", [])]
    # Only the container's sshd (4444) is used: fab, mpirun and `fab ssh` all go there; the host's
    # port 22 stays closed (host shells go through Session Manager).
    assert sorted((r["FromPort"], r["ToPort"]) for r in rules) == [(4444, 4444)]
    assert {r["CidrIp"] for r in rules} == {SSH_CIDR}


def test_network_without_ssh_cidr_has_no_cidr_ingress_at_all():
    stack = _stack()
    ClusterNetwork(stack, "Network", ssh_cidr=None)
    rules = [
        r
        for res in Template.from_stack(stack).find_resources("AWS::EC2::SecurityGroup").values()
        for r in res["Properties"].get("SecurityGroupIngress", [])
    ]
    assert rules == []


def test_network_is_public_subnets_without_nat_and_logs_rejected_flows():
    stack = _stack()
    ClusterNetwork(stack, "Network", ssh_cidr=SSH_CIDR)
    template = Template.from_stack(stack)
    template.resource_count_is("AWS::EC2::NatGateway", 0)
    template.resource_count_is("AWS::EC2::Subnet", 1)
    template.has_resource_properties("AWS::EC2::Subnet", {"MapPublicIpOnLaunch": True})
    template.has_resource_properties("AWS::EC2::FlowLog", {"TrafficType": "REJECT"})
    template.has_resource("AWS::Logs::LogGroup", {"DeletionPolicy": "Delete"})
    template.has_resource_properties(
        "AWS::Logs::LogGroup", {"RetentionInDays": 14, "KmsKeyId": {"Fn::GetAtt": [Match.any_value(), "Arn"]}}
    )
    template.has_resource_properties("AWS::KMS::Key", {"EnableKeyRotation": True, "PendingWindowInDays": 7})


def test_network_can_use_an_existing_vpc_and_subnet():
    stack = _stack()
    network = ClusterNetwork(
        stack,
        "Network",
        ssh_cidr=SSH_CIDR,
        vpc_id="vpc-0123456789abcdef0",
        subnet_id="subnet-0123456789abcdef0",
        availability_zone="us-east-1a",
    )
    template = Template.from_stack(stack)
    template.resource_count_is("AWS::EC2::VPC", 0)
    template.has_resource_properties("AWS::EC2::SecurityGroup", {"VpcId": "vpc-0123456789abcdef0"})
    assert network.subnet.subnet_id == "subnet-0123456789abcdef0"


# ---------------------------------------------------------------- storage


def _storage(retain: bool) -> Template:
    stack = _stack()
    vpc = ec2.Vpc(
        stack,
        "Vpc",
        max_azs=1,
        nat_gateways=0,
        subnet_configuration=[ec2.SubnetConfiguration(name="p", subnet_type=ec2.SubnetType.PUBLIC)],
    )
    clients = ec2.SecurityGroup(stack, "Clients", vpc=vpc)
    SharedStorage(
        stack, "Storage", vpc=vpc, subnet=vpc.public_subnets[0], client_security_group=clients, retain_data=retain
    )
    return Template.from_stack(stack)


def test_storage_is_encrypted_elastic_efs_with_one_mount_target_and_nfs_from_clients_only():
    template = _storage(retain=False)
    template.has_resource_properties(
        "AWS::EFS::FileSystem", {"Encrypted": True, "ThroughputMode": "elastic", "PerformanceMode": "generalPurpose"}
    )
    template.resource_count_is("AWS::EFS::MountTarget", 1)
    template.has_resource_properties(
        "AWS::EC2::SecurityGroupIngress",
        {"IpProtocol": "tcp", "FromPort": 2049, "ToPort": 2049, "SourceSecurityGroupId": Match.any_value()},
    )
    efs_sg = [
        r
        for r in template.find_resources("AWS::EC2::SecurityGroup").values()
        if "EFS" in r["Properties"]["GroupDescription"]
    ]
    assert efs_sg and "SecurityGroupIngress" not in efs_sg[0]["Properties"]


def _bootstrap_mount() -> dict:
    """How node-bootstrap.sh mounts /data: the file system type and options of its fstab line."""
    script = (REPO / "assets" / "bootstrap" / "node-bootstrap.sh").read_text()
    options = re.search(r"local options=(\S+)", script).group(1).split(",")
    fs_type = re.search(r"\$DATA_DIR (\w+) \$options", script).group(1)
    return {"type": fs_type, "iam": "iam" in options, "tls": "tls" in options}


def efs_client_allowed(policy: dict | None, action: str, *, iam: bool, tls: bool) -> bool:
    """EFS's decision for an NFS client reaching the file system through a mount target.
    No policy: the default policy grants every client full access. With a policy, an anonymous
    client (no `iam` mount option) matches only principal "*"; a Deny wins over an Allow."""
    if policy is None:
        return True
    context = {"elasticfilesystem:AccessedViaMountTarget": "true", "aws:SecureTransport": str(tls).lower()}

    def matches(statement: dict) -> bool:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        principal = statement.get("Principal", {})
        principal = principal.get("AWS", principal) if isinstance(principal, dict) else principal
        anyone = principal == "*" or principal == ["*"]
        conditions = all(
            context.get(key) == str(value).lower()
            for op, pairs in statement.get("Condition", {}).items()
            if op == "Bool"
            for key, value in pairs.items()
        )
        return (
            (f"elasticfilesystem:{action}" in actions or "elasticfilesystem:*" in actions)
            and (anyone or iam)
            and conditions
        )

    statements = policy["Statement"]
    if any(s["Effect"] == "Deny" and matches(s) for s in statements):
        return False
    return any(s["Effect"] == "Allow" and matches(s) for s in statements)


@pytest.mark.parametrize("action", ["ClientMount", "ClientWrite", "ClientRootAccess"])
def test_the_nodes_nfs_mount_is_allowed_by_the_file_system_policy(action):
    """With cdk.json's denyAnonymousAccess flag, CDK's policy omits ClientMount and EFS refuses
    the bootstrap's plain NFS mount (aws-cdk #33669): the policy must allow what the mount is."""
    mount = _bootstrap_mount()
    assert mount["type"] == "nfs4"  # no efs-utils: an anonymous client
    fs = next(iter(cluster_template().find_resources("AWS::EFS::FileSystem").values()))
    policy = fs["Properties"].get("FileSystemPolicy")
    assert efs_client_allowed(policy, action, iam=mount["iam"], tls=mount["tls"]), (
        f"EFS would refuse {action} to the bootstrap's NFS client: {json.dumps(policy)}"
    )


def test_the_policy_evaluator_refuses_what_efs_refuses():
    flag_policy = {
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"AWS": "*"},
                "Action": ["elasticfilesystem:ClientRootAccess", "elasticfilesystem:ClientWrite"],
                "Condition": {"Bool": {"elasticfilesystem:AccessedViaMountTarget": "true"}},
            }
        ]
    }
    assert not efs_client_allowed(flag_policy, "ClientMount", iam=False, tls=False)
    assert efs_client_allowed(flag_policy, "ClientWrite", iam=False, tls=False)
    tls_only = {
        "Statement": [
            {
                "Effect": "Deny",
                "Principal": {"AWS": "*"},
                "Action": "elasticfilesystem:*",
                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
            }
        ]
        + flag_policy["Statement"]
    }
    assert not efs_client_allowed(tls_only, "ClientWrite", iam=False, tls=False)
    assert efs_client_allowed(None, "ClientMount", iam=False, tls=False)


def test_the_subnet_is_in_an_az_that_offers_the_type():
    offered = {offerings_context_key("us-east-1", "p4d.24xlarge"): ["us-east-1f", "us-east-1c"]}
    template = cluster_template(region="us-east-1", instance_type="p4d.24xlarge", availability_zone=None, **offered)
    template.resource_count_is("AWS::EC2::Subnet", 1)
    template.has_resource_properties("AWS::EC2::Subnet", {"AvailabilityZone": "us-east-1c"})
    pinned = cluster_template(
        region="us-east-1", instance_type="p4d.24xlarge", availability_zone="us-east-1f", **offered
    )
    pinned.has_resource_properties("AWS::EC2::Subnet", {"AvailabilityZone": "us-east-1f"})


@pytest.mark.parametrize("instance_type, flavour", [("g5.12xlarge", "oss"), ("p3.8xlarge", "proprietary")])
def test_the_ami_is_the_dlami_whose_driver_supports_the_family(instance_type, flavour):
    """The pin `fab preflight` cached for the family's DLAMI parameter becomes every node's ImageId."""
    from stacks.config import ami_context_key
    from stacks.instance_types import AMI_PARAMETERS

    pinned = {
        ami_context_key("us-east-1", path): f"ami-0{str(i) * 16}" for i, path in enumerate(AMI_PARAMETERS.values())
    }
    expected = pinned[ami_context_key("us-east-1", AMI_PARAMETERS[flavour])]
    template = cluster_template(region="us-east-1", instance_type=instance_type, ami_id=None, **pinned)
    images = {i["Properties"]["ImageId"] for i in template.find_resources("AWS::EC2::Instance").values()}
    assert images == {expected}


@pytest.mark.parametrize("retain, policy", [(False, "Delete"), (True, "Retain")])
def test_storage_is_deleted_by_destroy_unless_retained(retain, policy):
    template = _storage(retain)
    template.has_resource("AWS::EFS::FileSystem", {"DeletionPolicy": policy, "UpdateReplacePolicy": policy})


# ---------------------------------------------------------------- nodes and the composed stack


def test_nodes_count_placement_imdsv2_and_encrypted_gp3(cluster):
    nodes, template = cluster
    template.resource_count_is("AWS::EC2::Instance", nodes)
    template.resource_count_is("AWS::EC2::PlacementGroup", 1)
    template.has_resource_properties("AWS::EC2::PlacementGroup", {"Strategy": "cluster"})
    instances = template.find_resources("AWS::EC2::Instance")
    assert len({json.dumps(i["Properties"]["SubnetId"]) for i in instances.values()}) == 1
    assert all("PlacementGroupName" in i["Properties"] for i in instances.values())
    template.has_resource_properties(
        "AWS::EC2::LaunchTemplate", {"LaunchTemplateData": {"MetadataOptions": {"HttpTokens": "required"}}}
    )
    template.has_resource_properties(
        "AWS::EC2::Instance",
        {
            "BlockDeviceMappings": [
                {
                    "DeviceName": "/dev/sda1",
                    "Ebs": {"VolumeType": "gp3", "Encrypted": True, "DeleteOnTermination": True, "VolumeSize": 200},
                }
            ]
        },
    )


def test_nodes_wait_for_their_bootstrap_signal_and_are_tagged_with_rank(cluster):
    nodes, template = cluster
    instances = template.find_resources("AWS::EC2::Instance")
    for resource in instances.values():
        assert resource["CreationPolicy"]["ResourceSignal"] == {"Count": 1, "Timeout": "PT45M"}
    ranks = sorted(
        int(t["Value"]) for i in instances.values() for t in i["Properties"]["Tags"] if t["Key"] == "gpu-cluster:rank"
    )
    assert ranks == list(range(nodes))


def test_no_ingress_from_the_world_and_a_self_referencing_rule(cluster):
    _, template = cluster
    for sg in template.find_resources("AWS::EC2::SecurityGroup").values():
        for rule in sg["Properties"].get("SecurityGroupIngress", []):
            assert rule.get("CidrIp") == SSH_CIDR
    template.has_resource_properties("AWS::EC2::SecurityGroupIngress", {"IpProtocol": "-1"})


def test_world_ssh_appears_only_with_the_opt_in():
    template = cluster_template(ssh_cidr="0.0.0.0/0", allow_world_ssh="true")
    rules = [
        r
        for sg in template.find_resources("AWS::EC2::SecurityGroup").values()
        for r in sg["Properties"].get("SecurityGroupIngress", [])
    ]
    assert {r["CidrIp"] for r in rules} == {"0.0.0.0/0"} and {r["FromPort"] for r in rules} == {4444}


def _user_data(template: Template, rank: int) -> str:
    instance = [
        i
        for i in template.find_resources("AWS::EC2::Instance").values()
        if {"Key": "gpu-cluster:rank", "Value": str(rank)} in i["Properties"]["Tags"]
    ][0]
    parts = instance["Properties"]["UserData"]["Fn::Base64"]
    if isinstance(parts, str):
        return parts
    return "".join(p if isinstance(p, str) else "<token>" for p in parts["Fn::Join"][1])


def test_user_data_is_the_stub_with_the_nodes_own_values_and_no_config(cluster):
    """The bootstrap travels as its own asset (tests/test_node_identity.py): user data only fetches it."""
    nodes, template = cluster
    text = _user_data(template, nodes - 1)
    assert text.startswith("#!/bin/bash")
    assert f"NODE_RANK={nodes - 1}\n" in text and "NODES=" not in text and "BASE_IMAGE" not in text
    assert "NODE_CONFIG_PARAMETER=/gpu-cluster/gpu-cluster/node-config\n" in text
    assert "aws s3 cp" in text and "signal-resource" in text and 'exec "$SCRIPT" "$ENV_FILE"' in text
    assert ">> /etc/fstab" not in text and "docker run" not in text  # the script's work, not the stub's
    for secret_marker in ("BEGIN OPENSSH PRIVATE KEY", "PRIVATE KEY", "aws_secret_access_key"):
        assert secret_marker not in text


# The longest value a token in the user data can resolve to (a stack name is at most 128
# characters, an S3 URL of a CDK asset about 130, a region 14, a file-system id 21).
TOKEN_BYTES_BOUND = 256
USER_DATA_LIMIT = 16 * 1024  # bytes, before base64 (EC2 user guide: "Work with instance user data")


def test_user_data_fits_the_ec2_limit_with_every_token_at_its_longest(cluster):
    nodes, template = cluster
    instance = next(iter(template.find_resources("AWS::EC2::Instance").values()))
    parts = instance["Properties"]["UserData"]["Fn::Base64"]
    parts = [parts] if isinstance(parts, str) else parts["Fn::Join"][1]
    size = sum(len(p.encode()) if isinstance(p, str) else TOKEN_BYTES_BOUND for p in parts)
    print(f"user data: {size} bytes at most ({USER_DATA_LIMIT - size} to spare)")
    assert size <= USER_DATA_LIMIT


def test_node_role_is_least_privilege():
    template = cluster_template()
    policies = template.find_resources("AWS::IAM::Policy")
    statements = [s for p in policies.values() for s in p["Properties"]["PolicyDocument"]["Statement"]]
    actions = sorted(a for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))
    assert "cloudformation:SignalResource" in actions and "ssm:PutParameter" in actions
    assert all("*" not in a for a in actions if not a.startswith("logs:"))
    # No AWS managed policy: AmazonSSMManagedInstanceCore reads every parameter (test_stack_contracts.py).
    assert not [r for r in template.find_resources("AWS::IAM::Role").values() if "ManagedPolicyArns" in r["Properties"]]


def test_the_stack_creates_a_key_pair_whose_private_key_is_in_ssm_unless_one_is_named():
    generated = cluster_template()
    generated.resource_count_is("AWS::EC2::KeyPair", 1)
    generated.has_output("KeyParameterName", {"Value": {"Fn::Join": ["", ["/ec2/keypair/", Match.any_value()]]}})
    named = cluster_template(key_name="my-key")
    named.resource_count_is("AWS::EC2::KeyPair", 0)
    named.has_output("KeyParameterName", {"Value": "none"})
    named.has_resource_properties("AWS::EC2::Instance", {"KeyName": "my-key"})


def test_outputs_for_the_fab_tasks(cluster):
    nodes, template = cluster
    outputs = template.find_outputs("*")
    for key in (
        "HeadPublicIp",
        "PrivateIps",
        "PublicIps",
        "InstanceIds",
        "FileSystemId",
        "KeyParameterName",
        "HostKeyParameterName",
        "Region",
        "GpusPerNode",
    ):
        assert key in outputs, key
    value = outputs["PrivateIps"]["Value"]
    items = value["Fn::Join"][1] if "Fn::Join" in value else [value]  # one node: no join
    assert [item["Fn::GetAtt"][1] for item in items] == ["PrivateIp"] * nodes
    assert outputs["GpusPerNode"]["Value"] == "1"


def test_placement_group_can_be_turned_off():
    template = cluster_template(placement_group="false")
    template.resource_count_is("AWS::EC2::PlacementGroup", 0)


# ---------------------------------------------------------------- GPU nodes built alone


def _nodes_alone(assets_dir, **context) -> Template:
    from stacks.nodes import GpuNodes

    stack = _stack()
    vpc = ec2.Vpc(
        stack,
        "Vpc",
        max_azs=1,
        nat_gateways=0,
        subnet_configuration=[ec2.SubnetConfiguration(name="p", subnet_type=ec2.SubnetType.PUBLIC)],
    )
    group = ec2.SecurityGroup(stack, "NodeGroup", vpc=vpc)
    storage = SharedStorage(
        stack, "Storage", vpc=vpc, subnet=vpc.public_subnets[0], client_security_group=group, retain_data=False
    )
    GpuNodes(
        stack,
        "Nodes",
        config=ClusterConfig.from_context({"nodes": "2", "ami_id": AMI, **context}),
        vpc=vpc,
        subnet=vpc.public_subnets[0],
        security_group=group,
        file_system=storage.file_system,
        assets_dir=assets_dir,
    )
    return Template.from_stack(stack)


def test_editing_the_training_code_replaces_no_node(tmp_path):
    """The code's asset hash lives in an SSM parameter, not in user data (which replaces nodes)."""
    import shutil

    assets = tmp_path / "assets"
    shutil.copytree(REPO / "assets", assets, ignore=shutil.ignore_patterns("__pycache__"))
    before = _nodes_alone(assets)
    with open(assets / "train" / "trainer.py", "a") as handle:
        handle.write("# an edit\n")
    after = _nodes_alone(assets)
    instances = [t.find_resources("AWS::EC2::Instance") for t in (before, after)]
    assert instances[0].keys() == instances[1].keys()
    for logical_id in instances[0]:
        assert instances[0][logical_id]["Properties"]["UserData"] == instances[1][logical_id]["Properties"]["UserData"]
    values = [
        json.dumps(
            next(
                r["Properties"]["Value"]
                for r in t.find_resources("AWS::SSM::Parameter").values()
                if "image-context" in json.dumps(r["Properties"]["Name"])
            )
        )
        for t in (before, after)
    ]
    assert values[0] != values[1], "the new code must still reach new nodes through the parameter"


def test_user_data_stays_under_ec2s_16_kb_with_the_longest_values_and_over_it_is_one_line():
    from stacks.bootstrap import USER_DATA_LIMIT, check_user_data_size

    longest = {
        "cluster_name": "c" * 31,
        "image": "nvcr.io/" + "n" * 200 + ":" + "t" * 40,
        "nodes": "64",
        "idle_minutes": "1410",
    }
    template = cluster_template(**longest)
    sizes = [
        check_user_data_size(i["Properties"]["UserData"], "node")
        for i in template.find_resources("AWS::EC2::Instance").values()
    ]
    print(f"user data: {max(sizes)} of {USER_DATA_LIMIT} bytes")
    assert max(sizes) < USER_DATA_LIMIT
    oversized = {"Fn::Base64": {"Fn::Join": ["", ["#!/bin/bash\n" + "x" * USER_DATA_LIMIT, {"Ref": "AWS::Region"}]]}}
    with pytest.raises(ValueError, match=r"node0: user data would be \d+ bytes, over EC2's 16384") as caught:
        check_user_data_size(oversized, "node0")
    assert "\n" not in str(caught.value)


def test_the_dashboard_shows_every_node_and_the_file_system_and_its_url_is_an_output(cluster):
    nodes, template = cluster
    dashboards = template.find_resources("AWS::CloudWatch::Dashboard")
    assert len(dashboards) == 1
    body = json.dumps(next(iter(dashboards.values()))["Properties"]["DashboardBody"])
    for metric in (
        "GPUUtilization",
        "GPUMemoryUsedPercent",
        "CPUUtilization",
        "NetworkIn",
        "NetworkOut",
        "Busy",
        "DataReadIOBytes",
        "DataWriteIOBytes",
        "BurstCreditBalance",
    ):
        assert metric in body, metric
    assert body.count('\\"label\\":\\"node') == 6 * nodes  # six per-node graphs, a line per node
    url = json.dumps(template.find_outputs("DashboardUrl"))
    assert "#dashboards:name=gpu-cluster" in url


def test_the_dashboards_ec2_metrics_are_graphed_at_the_5_minutes_ec2_sends_them_at(cluster):
    """Without detailed monitoring (the nodes' launch templates), EC2 sends AWS/EC2 metrics every 5 minutes:
    "If you are using basic (5-minute) monitoring and the statistic is Sum, you can divide this number by 300"
    (EC2 User Guide, instance metrics). A shorter period would show 5 minutes of bytes as one minute's."""
    _, template = cluster
    [dashboard] = template.find_resources("AWS::CloudWatch::Dashboard").values()
    parts = dashboard["Properties"]["DashboardBody"]["Fn::Join"][1]
    body = json.loads("".join(part if isinstance(part, str) else "token" for part in parts))
    periods = {}
    for widget in body["widgets"]:
        for metric in widget["properties"]["metrics"]:
            # CDK leaves out the dashboard's default period, 300 (Dashboard Body Structure, metric widget)
            periods.setdefault(metric[0], set()).add(metric[-1].get("period", 300))
    assert periods["AWS/EC2"] == {300} and periods["AWS/EFS"] == {60}, periods
    assert not any(data.get("Monitoring", {}).get("Enabled") for data in launch_templates(template))
    assert all("/ min)" not in widget["properties"]["title"] for widget in body["widgets"])


# ---------------------------------------------------------------- access=ssm


def _ingress(template: Template) -> list[dict]:
    rules = [
        r
        for sg in template.find_resources("AWS::EC2::SecurityGroup").values()
        for r in sg["Properties"].get("SecurityGroupIngress", [])
    ]
    return rules + [r["Properties"] for r in template.find_resources("AWS::EC2::SecurityGroupIngress").values()]


@pytest.mark.parametrize("private", ["false", "true"])
def test_access_ssm_has_no_ingress_from_outside_the_cluster(private):
    template = cluster_template(ssh_cidr=None, access="ssm", private_subnet=private)
    for rule in _ingress(template):
        assert "CidrIp" not in rule and "CidrIpv6" not in rule, rule
        assert "SourceSecurityGroupId" in rule
    template.has_output("Access", {"Value": "ssm"})


def test_a_private_subnet_has_no_public_ips_a_nat_and_session_manager_endpoints():
    template = cluster_template(ssh_cidr=None, access="ssm", private_subnet="true")
    template.resource_count_is("AWS::EC2::NatGateway", 1)
    services = json.dumps(
        [e["Properties"]["ServiceName"] for e in template.find_resources("AWS::EC2::VPCEndpoint").values()]
    )
    for service in (".ssm", ".ssmmessages", ".ec2messages", ".s3"):
        assert service in services, service
    node_subnets = {
        json.dumps(i["Properties"]["SubnetId"]) for i in template.find_resources("AWS::EC2::Instance").values()
    }
    private = [
        logical
        for logical, subnet in template.find_resources("AWS::EC2::Subnet").items()
        if not subnet["Properties"].get("MapPublicIpOnLaunch")
    ]
    assert node_subnets == {json.dumps({"Ref": private[0]})}
    template.has_output("PublicIps", {"Value": "none"})


# ---------------------------------------------------------------- Spot nodes


@pytest.mark.parametrize("max_price, expected", [(None, None), ("0.45", "0.45"), ("12.5", "12.5")])
def test_spot_nodes_are_persistent_requests_stopped_when_interrupted(max_price, expected):
    template = cluster_template(nodes="3", spot="true", **({"spot_max_price": max_price} if max_price else {}))
    datas = launch_templates(template)
    assert len(datas) == 3
    for data in datas:
        assert data["MetadataOptions"] == {"HttpTokens": "required", "HttpPutResponseHopLimit": 1}
        options = data["InstanceMarketOptions"]
        assert options["MarketType"] == "spot"
        spot = options["SpotOptions"]
        assert (spot["SpotInstanceType"], spot["InstanceInterruptionBehavior"]) == ("persistent", "stop")
        assert spot["ValidUntil"] > "2090" and spot.get("MaxPrice") == expected
    ranks = sorted(
        tag["Value"]
        for data in datas
        for spec in data["TagSpecifications"]
        for tag in spec["Tags"]
        if spec["ResourceType"] == "spot-instances-request" and tag["Key"] == "gpu-cluster:rank"
    )
    assert ranks == ["0", "1", "2"]
    # Each instance uses its own template's latest version, so the market options apply at launch.
    for instance in template.find_resources("AWS::EC2::Instance").values():
        assert instance["Properties"]["LaunchTemplate"]["Version"]["Fn::GetAtt"][1] == "LatestVersionNumber"
    template.has_output("Spot", {"Value": "true"})
    assert "SPOT=" not in _user_data(template, 2)  # in the node config: turning Spot on changes no user data
    (config,) = [
        json.dumps(r["Properties"]["Value"])
        for r in template.find_resources("AWS::SSM::Parameter").values()
        if r["Properties"]["Name"].endswith("/node-config")
    ]
    assert "SPOT=true" in config


def test_on_demand_nodes_have_no_market_options_and_unchanged_user_data(cluster):
    _, template = cluster
    assert all(
        "InstanceMarketOptions" not in data and "TagSpecifications" not in data for data in launch_templates(template)
    )
    template.has_output("Spot", {"Value": "false"})
    assert "SPOT=" not in _user_data(template, 0)  # the node config says SPOT=false


# ---------------------------------------------------------------- outputs


def test_the_stack_outputs_are_what_the_inventory_reads():
    """One list of output keys (assets/cluster_node) for the stack and the inventory."""
    from cluster_node.protocol.contract import OUTPUT_KEYS, REQUIRED_OUTPUTS

    outputs = set(cluster_template().find_outputs("*"))
    assert outputs == set(OUTPUT_KEYS) - {"SpotMaxPrice"}
    assert set(REQUIRED_OUTPUTS) <= outputs
    spot = cluster_template(instance_type="g5.2xlarge", spot="true", spot_max_price="0.45").find_outputs("*")
    assert set(spot) == set(OUTPUT_KEYS) and spot["SpotMaxPrice"]["Value"] == "0.45"
