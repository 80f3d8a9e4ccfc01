"""A second `cdk deploy` of a deployed cluster, checked by `fab preflight` (clusterops/aws/redeploy.py) against
a moto server's stack and instances: CDK does not remember `-c` values between deploys, so preflight says
what the deploy would change in the cluster of that name (or that it makes a new one beside the region's
others), and keeps the subnet in the AZ the nodes are in (CloudFormation cannot move a subnet to another AZ
in an update): synth reads that pin, and a type not offered there is one line at preflight and at synth."""

import ipaddress
import itertools
import json

import boto3
import pytest
from templates_golden import CONFIGS, GOLDEN, PINS

from clusterops.aws import preflight, redeploy
from stacks.cluster_stack import config_outputs
from stacks.config import ClusterConfig, cluster_az_context_key, offerings_context_key
from stacks.pins import UnpinnedError, synth_config, unpinned_config
from stacks.userdata import user_data_version

REGION = "us-east-1"


def _deploy(
    name: str, zone: str, nodes: int, subnet: tuple[str, str] | None = None, extra: dict | None = None, **outputs
) -> list[str]:
    """A stack with this app's outputs and its nodes' instances in `zone` (moto runs no real template here:
    tests/test_rehearsal.py runs preflight against the real one)."""
    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    launched = ec2.run_instances(
        ImageId=image, MinCount=nodes, MaxCount=nodes, InstanceType="g5.xlarge", Placement={"AvailabilityZone": zone}
    )
    ids = [i["InstanceId"] for i in launched["Instances"]]
    values = {"ClusterName": name, "InstanceType": "g5.xlarge", "Spot": "false", "EfaCards": "0", "Access": "ssh"}
    values["NodeUserData"] = user_data_version()  # deployed by this checkout
    values |= outputs | {"InstanceIds": ",".join(ids)}
    resources: dict = {"Handle": {"Type": "AWS::CloudFormation::WaitConditionHandle"}, **(extra or {})}
    if subnet:  # the stack's own subnet: (CIDR, AZ)
        vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
        properties = {"VpcId": vpc, "CidrBlock": subnet[0], "AvailabilityZone": subnet[1]}
        resources["Subnet"] = {"Type": "AWS::EC2::Subnet", "Properties": properties}
    template = {
        "Resources": resources,
        "Outputs": {key: {"Value": value} for key, value in values.items()},
    }
    boto3.client("cloudformation").create_stack(StackName=f"GpuCluster-{name}", TemplateBody=json.dumps(template))
    return ids


def _check(config: ClusterConfig, stack: str):
    check, found = redeploy.redeploy_check(boto3.client("cloudformation"), boto3.client("ec2"), config, stack)
    return check, found.zone if found else None


def test_a_deploy_without_the_first_ones_cluster_name_is_a_new_cluster_and_says_which_exist(aws_env, tmp_path):
    _deploy("redeploy-a", "us-east-1b", 2)
    check, zone = _check(ClusterConfig.from_context({}), "GpuCluster-redeploy-none")
    assert check.ok and zone is None
    assert check.detail.startswith("none named GpuCluster-redeploy-none: this deploy makes a new cluster; this region")
    assert "GpuCluster-redeploy-a" in check.detail and "-c cluster_name=NAME" in check.detail
    context = tmp_path / "cdk.context.json"
    context.write_text(json.dumps({cluster_az_context_key(REGION, "redeploy-none"): "us-east-1c"}))
    redeploy.pin_zone(context, REGION, "redeploy-none", zone, exists=False)  # no stack: a stale pin goes
    assert json.loads(context.read_text()) == {}


def test_each_change_a_deploy_would_make_to_the_deployed_cluster_is_named(aws_env):
    _deploy("redeploy-b", "us-east-1b", 3, Spot="true", SpotMaxPrice="on-demand")
    first = {"cluster_name": "redeploy-b", "nodes": "3", "instance_type": "g5.xlarge", "spot": "true"}
    check, zone = _check(ClusterConfig.from_context(first), "GpuCluster-redeploy-b")
    assert zone == "us-east-1b" and "this deploy changes none of its nodes by type" in check.detail, check.detail
    assert check.detail.endswith("`npx cdk diff` lists every resource it replaces")
    reverted = ClusterConfig.from_context({"cluster_name": "redeploy-b"})  # the keys left out: their defaults
    check, _ = _check(reverted, "GpuCluster-redeploy-b")
    assert check.ok and "instance_type g5.xlarge -> g4dn.2xlarge (replaces every node" in check.detail
    assert "spot true -> false (replaces every node" in check.detail
    assert "nodes 3 -> 2 (node2 terminated, their disks with them)" in check.detail
    assert "-c values are not remembered" in check.detail and "\n" not in check.detail


def test_a_spot_clusters_max_price_left_out_replaces_every_node(aws_env):
    """MaxPrice lives in each node's launch template; a new version replaces the node (AWS::EC2::Instance
    LaunchTemplate: "Update requires: Replacement"). The eighth read: a deploy of 2 -> 3 nodes without the first
    one's -c spot_max_price said "replaces none"."""
    _deploy("redeploy-g", "us-east-1b", 2, Spot="true", SpotMaxPrice="0.45")
    first = {"cluster_name": "redeploy-g", "instance_type": "g5.xlarge", "spot": "true", "spot_max_price": "0.45"}
    check, _ = _check(ClusterConfig.from_context({**first, "nodes": "3"}), "GpuCluster-redeploy-g")
    assert "nodes 2 -> 3 (adds 1, replaces none)" in check.detail and "spot_max_price" not in check.detail
    left_out = ClusterConfig.from_context({**first, "spot_max_price": None, "nodes": "3"})
    check, _ = _check(left_out, "GpuCluster-redeploy-g")
    assert "spot_max_price 0.45 -> on-demand (replaces every node" in check.detail, check.detail
    check, _ = _check(
        ClusterConfig.from_context({**first, "spot": "false", "spot_max_price": None}), "GpuCluster-redeploy-g"
    )
    assert "spot true -> false (replaces every node" in check.detail and "spot_max_price" not in check.detail
    older = redeploy.Deployed("GpuCluster-g", "UPDATE_COMPLETE", {"Spot": "true"}, None)  # before the output
    said = redeploy.changes(left_out, older)
    assert "spot_max_price not known (an older version deployed it): a price other than its first" in said[-1]


def test_an_upgrade_of_this_app_or_a_new_ami_is_said_to_replace_every_node(aws_env):
    """CDK appends a hash of each node's user data to its logical ID (user_data_causes_replacement): a new
    stub (this app upgraded) replaces every node, as a new AMI does; the stack outputs its user data's
    version for this. An older stack has no such output: it may. Each says to stop the cluster first (the old
    nodes' idle watchdog knows no bootstrapping node, and would stop the new ones)."""
    config = ClusterConfig.from_context({"cluster_name": "redeploy-e", "instance_type": "g5.xlarge"})
    base = {"InstanceType": "g5.xlarge", "Spot": "false", "EfaCards": "0", "Access": "ssh"}
    for outputs, words in [
        ({"NodeUserData": "0123456789abcdef"}, f"node user data 0123456789abcdef -> {user_data_version()} (replaces"),
        ({}, "node user data not known (an older version deployed it) (replaces every node"),
    ]:
        found = redeploy.Deployed("GpuCluster-redeploy-e", "UPDATE_COMPLETE", base | outputs, None)
        said = redeploy.changes(config, found)
        assert len(said) == 1 and said[0].startswith(words) and "`fab stop-cluster` before the deploy" in said[0]
    ids = _deploy("redeploy-e", "us-east-1b", 2)
    image = boto3.client("ec2").describe_instances(InstanceIds=ids)["Reservations"][0]["Instances"][0]["ImageId"]
    found = redeploy.deployed(boto3.client("cloudformation"), boto3.client("ec2"), "GpuCluster-redeploy-e")
    assert found is not None and redeploy.changes(config, found, image) == []
    assert redeploy.changes(config, found, "ami-0fffffffffffffff0") == [
        f"AMI {image} -> ami-0fffffffffffffff0 (replaces every node: a running run ends, `fab stop` it first)"
    ]


def test_the_subnet_stays_in_the_deployed_nodes_az_and_a_type_not_offered_there_is_refused(aws_env, tmp_path):
    """moto's offerings: the deployed zone is not the first by name, which synth would otherwise pick."""
    ec2 = boto3.client("ec2")
    zones = preflight.offered_zones(ec2, "g5.xlarge")
    deployed = zones[-1]
    assert deployed != sorted(zones)[0]
    _deploy("redeploy-c", deployed, 2)
    config = ClusterConfig.from_context({"cluster_name": "redeploy-c", "instance_type": "g5.xlarge"})
    _, zone = _check(config, "GpuCluster-redeploy-c")
    context = tmp_path / "cdk.context.json"
    redeploy.pin_zone(context, REGION, "redeploy-c", zone, exists=True)
    pinned = json.loads(context.read_text()) | {offerings_context_key(REGION, "g5.xlarge"): zones}
    synth = ClusterConfig.from_context({**pinned, "cluster_name": "redeploy-c", "instance_type": "g5.xlarge"}, REGION)
    assert synth.availability_zone == deployed
    where, az = preflight.placement(config, zones, zone)
    assert where.ok and az == deployed

    elsewhere = [z for z in zones if z != deployed]
    moved = ClusterConfig.from_context({"cluster_name": "redeploy-c", "instance_type": "p4d.24xlarge", "access": "ssm"})
    where, _ = preflight.placement(moved, elsewhere, zone)
    assert not where.ok and where.detail.startswith(f"p4d.24xlarge is not offered in {deployed}, where the deployed")
    assert "`fab destroy`, then `fab preflight` and deploy" in where.detail
    context_p4d = pinned | {offerings_context_key(REGION, "p4d.24xlarge"): elsewhere, "access": "ssm"}
    context_p4d |= {"cluster_name": "redeploy-c", "instance_type": "p4d.24xlarge", "ami_id": "ami-0123456789abcdef0"}
    with pytest.raises(UnpinnedError, match=f"not offered in {deployed}, where the deployed cluster's subnet is"):
        synth_config(context_p4d, REGION)  # an error annotation: synth, diff and deploy fail on it
    assert unpinned_config(context_p4d, REGION).cluster_name == "redeploy-c"  # `cdk destroy` still names it
    explicit = ClusterConfig.from_context({"cluster_name": "redeploy-c", "availability_zone": elsewhere[0]})
    where, _ = preflight.placement(explicit, zones, zone)
    assert not where.ok and f"but the deployed cluster's subnet is in {deployed}" in where.detail


def test_a_deployed_clusters_pin_is_kept_when_its_nodes_do_not_show_and_a_stuck_stack_fails(aws_env, tmp_path):
    """Nodes terminated outside CloudFormation (DescribeInstances forgets them after about an hour) do not
    unpin the AZ while the stack exists; a stack `cdk deploy` cannot update is a FAIL that says what to run."""
    _deploy("redeploy-d", "us-east-1a", 1, subnet=("172.31.250.0/24", "us-east-1d"))
    config = ClusterConfig.from_context({"cluster_name": "redeploy-d", "nodes": "1"})
    assert _check(config, "GpuCluster-redeploy-d")[1] == "us-east-1d"  # the stack's subnet says, not its nodes
    context = tmp_path / "cdk.context.json"
    key = cluster_az_context_key(REGION, "redeploy-d")
    context.write_text(json.dumps({key: "us-east-1c"}))
    redeploy.pin_zone(context, REGION, "redeploy-d", None, exists=True)
    assert json.loads(context.read_text()) == {key: "us-east-1c"}
    for status, words in [
        ("UPDATE_ROLLBACK_FAILED", "continue-update-rollback --stack-name GpuCluster-x"),
        ("DELETE_FAILED", "`fab destroy` again"),
        ("UPDATE_IN_PROGRESS", "wait until it ends"),
    ]:
        found = redeploy.Deployed("GpuCluster-x", status, {}, "us-east-1c")
        assert words in (redeploy.stuck(found) or ""), status
    for deployable in ("UPDATE_ROLLBACK_COMPLETE", "REVIEW_IN_PROGRESS"):  # the CLI deploys over both
        assert redeploy.stuck(redeploy.Deployed("GpuCluster-x", deployable, {}, None)) is None


def _network_of(name: str) -> tuple[dict, frozenset[str]]:
    """A golden template's subnets ({logical ID: (CIDR, AZ)}) and its resource types, as a deployed stack
    lists them."""
    resources = json.loads((GOLDEN / f"{name}.template.json").read_text())["Resources"]
    subnets = {
        key: (r["Properties"]["CidrBlock"], json.dumps(r["Properties"].get("AvailabilityZone")))
        for key, r in resources.items()
        if r["Type"] == "AWS::EC2::Subnet"
    }
    return subnets, frozenset(r["Type"] for r in resources.values())


def _update_fails_on_a_subnet(before: dict, after: dict) -> bool:
    """CloudFormation creates a new or replaced subnet (CIDR and AZ: "Update requires: Replacement") before it
    deletes the old one: one that overlaps a subnet of the deployed stack fails (CreateSubnet: "the subnets'
    CIDR blocks must not overlap")."""
    made = [cidr for key, (cidr, zone) in after.items() if before.get(key) != (cidr, zone)]
    return any(
        ipaddress.ip_network(new).overlaps(ipaddress.ip_network(old)) for new in made for old, _ in before.values()
    )


@pytest.mark.parametrize("first, second", list(itertools.permutations(sorted(CONFIGS), 2)))
def test_a_redeploy_whose_subnets_would_overlap_the_deployed_ones_is_refused_at_preflight(first, second):
    """Every pair of the golden configurations, one deployed and then the other deployed over it (the pair's
    nodes changes aside): where the update would fail on a subnet, preflight's deployed-cluster line is a FAIL
    that says what to run; where it would not, the line does not stop it. The public and the private layouts
    share 10.42.0.0/16, so private_subnet never changes on a deployed cluster (the eighth read: the EFA error's
    own advice, `-c access=ssm -c private_subnet=true`, took a public cluster there)."""
    (before, types), (after, _) = _network_of(first), _network_of(second)
    found = redeploy.Deployed(f"GpuCluster-{first}", "UPDATE_COMPLETE", {}, "us-east-1a", resource_types=types)
    config = ClusterConfig.from_context({**PINS, **CONFIGS[second]})
    refusal = redeploy.subnet_layout_change(config, found)
    assert (refusal is not None) == _update_fails_on_a_subnet(before, after), (first, second, refusal)
    if refusal:
        assert "cannot change on a deployed cluster" in refusal and "`fab destroy`" in refusal


MOUNT = {"AWS::EFS::MountTarget", "AWS::EC2::Instance"}
NAT = {"AWS::EC2::VPC", "AWS::EC2::NatGateway", *MOUNT}


def test_a_private_subnet_change_is_a_fail_against_the_deployed_stack_and_the_quota_counts_what_is_added(aws_env):
    """Against a moto stack with its own VPC (the public layout): private_subnet=true is refused before any
    deploy, the same keys pass; and the vCPU quota counts the nodes the deploy launches, not the cluster's own
    running ones twice (all of them where it replaces every node: both run for a while)."""
    vpc = {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlock": "10.42.0.0/16"}}
    _deploy("redeploy-f", "us-east-1b", 2, extra={"Vpc": vpc})
    same = {"cluster_name": "redeploy-f", "instance_type": "g5.xlarge"}
    check, found = redeploy.redeploy_check(
        boto3.client("cloudformation"),
        boto3.client("ec2"),
        ClusterConfig.from_context({**same, "access": "ssm", "private_subnet": "true"}),
        "GpuCluster-redeploy-f",
    )
    assert not check.ok and found is not None and found.private_subnet is False
    assert check.detail.startswith("GpuCluster-redeploy-f: private_subnet false -> true cannot change"), check.detail
    assert "deploy with -c private_subnet=false, or `fab fetch`" in check.detail
    config = ClusterConfig.from_context(same)
    assert _check(config, "GpuCluster-redeploy-f")[0].ok
    assert redeploy.nodes_added(config, found) == 0  # an ssh_cidr or idle_minutes redeploy
    assert redeploy.nodes_added(ClusterConfig.from_context({**same, "nodes": "3"}), found) == 1
    assert redeploy.nodes_added(ClusterConfig.from_context({**same, "instance_type": "g5.2xlarge"}), found) == 2
    assert redeploy.nodes_added(config, None) == 2
    boto3.client("ec2").stop_instances(InstanceIds=found.instance_ids[1:])  # an autostopped node counts nowhere
    after_stop = redeploy.deployed(boto3.client("cloudformation"), boto3.client("ec2"), "GpuCluster-redeploy-f")
    assert after_stop is not None and redeploy.nodes_added(config, after_stop) == 1
    given = ClusterConfig.from_context(
        {**same, "vpc_id": "vpc-0a1b2c3d", "subnet_id": "subnet-0a1b2c3d", "availability_zone": "us-east-1a"}
    )
    moved = redeploy.subnet_layout_change(given, found) or ""  # EFS: mount targets "in one VPC at a time"
    assert moved.startswith("GpuCluster-redeploy-f: its own VPC -> -c vpc_id cannot change on a deployed"), moved
    in_given = redeploy.Deployed("GpuCluster-x", "UPDATE_COMPLETE", {}, None, resource_types=frozenset(MOUNT))
    assert "a given VPC -> its own" in (redeploy.subnet_layout_change(config, in_given) or "")
    assert redeploy.subnet_layout_change(given, in_given) is None
    unknown = redeploy.Deployed("GpuCluster-x", "UPDATE_COMPLETE", {}, None)  # its resources not listed
    assert redeploy.subnet_layout_change(config, unknown) is None and unknown.private_subnet is None
    review = redeploy.Deployed("GpuCluster-x", "REVIEW_IN_PROGRESS", {}, None, resource_types=frozenset())
    assert redeploy.subnet_layout_change(config, review) is None  # a change set never run holds nothing yet
    private = redeploy.Deployed("GpuCluster-x", "UPDATE_COMPLETE", {}, None, resource_types=frozenset(NAT))
    keep = "deploy with -c access=ssm -c private_subnet=true, or"
    assert keep in (redeploy.subnet_layout_change(config, private) or "")


def test_a_scale_up_that_leaves_out_a_first_deploys_value_names_what_it_changes_and_counts_every_node():
    """The twelfth read: a 2 -> 4 deploy without the first one's -c root_volume_gb=500 was "adds 2, replaces
    none", and the vCPU quota was checked for 2 nodes, when the new root volume replaces node0 and node1
    (BlockDeviceMapping: "Modifying any other parameter results in instance replacement"); a retain_data left
    out made `cdk destroy` delete /data."""
    first = {
        "cluster_name": "scale",
        "root_volume_gb": "500",
        "key_name": "mine",
        "retain_data": "true",
        "image": "nvcr.io/nvidia/pytorch:25.01-py3",
        "idle_minutes": "0",
        "data_bucket": "my-imagenet",
    }
    outputs = {**config_outputs(ClusterConfig.from_context(first)), "InstanceIds": "i-0a,i-0b", "KeyName": "mine"}
    outputs["NodeUserData"] = user_data_version()
    running = frozenset({"i-0a", "i-0b"})
    found = redeploy.Deployed("GpuCluster-scale", "UPDATE_COMPLETE", outputs, "us-east-1a", running=running)
    same = ClusterConfig.from_context({**first, "nodes": "4"})
    assert redeploy.changes(same, found) == ["nodes 2 -> 4 (adds 2, replaces none)"]
    assert redeploy.nodes_added(same, found) == 2
    left_out = ClusterConfig.from_context({"cluster_name": "scale", "nodes": "4"})
    said = "; ".join(redeploy.changes(left_out, found))
    for change in (
        f"root_volume_gb 500 -> 200 ({redeploy.REPLACES})",
        f"key_name mine -> scale-GpuCluster-scale ({redeploy.MAY_REPLACE})",
        "retain_data true -> false (whether `cdk destroy` deletes /data)",
        "image nvcr.io/nvidia/pytorch:25.01-py3 -> nvcr.io/nvidia/pytorch:24.12-py3 (each node boots the image",
        "idle_minutes 0 -> 60 (when the idle watchdog stops the cluster)",
        "data_bucket my-imagenet -> none (the bucket the nodes may read)",
    ):
        assert change in said, said
    assert redeploy.nodes_added(left_out, found) == 4  # each replacement is launched before its node goes
    unplaced = ClusterConfig.from_context({**first, "placement_group": "false"})
    assert f"placement_group true -> false ({redeploy.MAY_REPLACE})" in redeploy.changes(unplaced, found)
