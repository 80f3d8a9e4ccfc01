"""Issue 19 §17 and §20 (audit): `fab audit --delete` refuses while the cluster's stack is alive,
lists and deletes NAT gateways, VPC endpoints, KMS keys and dashboards, reads every page of
describe_file_systems, and treats a volume EC2 is already deleting as gone. Against the moto
server; what moto cannot show (a second page, a volume in `deleting`) with botocore's Stubber."""

import uuid

import boto3
from botocore.stub import Stubber
from conftest import run_fab

from clusterops.aws import audit

TEMPLATE = '{"Resources": {"Topic": {"Type": "AWS::SNS::Topic"}}}'


def clients():
    from fabfile.aws import AUDIT_CLIENTS

    return {k: boto3.client(k) for k in AUDIT_CLIENTS}


def tagged(cluster: str, kind: str) -> list[dict]:
    return [{"ResourceType": kind, "Tags": [{"Key": "gpu-cluster:name", "Value": cluster}]}]


def test_delete_refuses_while_the_clusters_stack_exists(aws_env):
    """A live stack's resources belong to CloudFormation: `cdk destroy` deletes them in order, and
    deleting /data under a running cluster loses the data (CloudFormation then fails its own delete)."""
    cluster = f"live{uuid.uuid4().hex[:6]}"
    cfn = boto3.client("cloudformation")
    cfn.create_stack(
        StackName=f"Custom-{cluster}",  # -c stack_name=...: found by the stack tag CDK gives it
        TemplateBody=TEMPLATE,
        Tags=[{"Key": "gpu-cluster:name", "Value": cluster}],
    )
    volume = boto3.client("ec2").create_volume(
        AvailabilityZone="us-east-1a", Size=1, TagSpecifications=tagged(cluster, "volume")
    )["VolumeId"]
    refused = run_fab("audit", "--cluster", cluster, "--delete", "--yes", **aws_env)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"error: stack Custom-{cluster} (CREATE_COMPLETE) still holds cluster {cluster}: "
        "`npx cdk destroy` it first (fab audit --delete --force deletes under a live stack)"
    ]
    assert boto3.client("ec2").describe_volumes(VolumeIds=[volume])["Volumes"]  # nothing deleted
    forced = run_fab("audit", "--cluster", cluster, "--delete", "--yes", "--force", **aws_env)
    assert forced.returncode == 0, forced.stderr
    assert f"deleted volume {volume}" in forced.stdout
    cfn.delete_stack(StackName=f"Custom-{cluster}")


def test_nat_gateways_endpoints_keys_and_dashboards_are_listed_and_deleted(aws_env):
    """What a private-subnet stack bills while it exists (Amazon VPC pricing: NAT gateway and
    interface endpoint hours; KMS pricing: $1 per key-month, none while pending deletion;
    CloudWatch pricing: $3 per dashboard-month)."""
    cluster = f"net{uuid.uuid4().hex[:6]}"
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.9.0.0/24")["Subnet"]["SubnetId"]
    eip = ec2.allocate_address(Domain="vpc")["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=subnet, AllocationId=eip, TagSpecifications=tagged(cluster, "natgateway"))[
        "NatGateway"
    ]["NatGatewayId"]
    # another cluster's, on the same server (moto lists every NAT gateway whatever the tag filter says)
    other_eip = ec2.allocate_address(Domain="vpc")["AllocationId"]
    other = ec2.create_nat_gateway(
        SubnetId=subnet, AllocationId=other_eip, TagSpecifications=tagged(f"{cluster}x", "natgateway")
    )["NatGateway"]["NatGatewayId"]
    endpoint = ec2.create_vpc_endpoint(
        VpcId=vpc,
        ServiceName="com.amazonaws.us-east-1.ssm",
        VpcEndpointType="Interface",
        SubnetIds=[subnet],
        TagSpecifications=tagged(cluster, "vpc-endpoint"),
    )["VpcEndpoint"]["VpcEndpointId"]
    kms = boto3.client("kms")
    key = kms.create_key(Tags=[{"TagKey": "gpu-cluster:name", "TagValue": cluster}])["KeyMetadata"]["KeyId"]
    gone = kms.create_key(Tags=[{"TagKey": "gpu-cluster:name", "TagValue": cluster}])["KeyMetadata"]["KeyId"]
    kms.schedule_key_deletion(KeyId=gone, PendingWindowInDays=7)  # pending deletion: no longer billed
    boto3.client("cloudwatch").put_dashboard(DashboardName=cluster, DashboardBody='{"widgets": []}')
    found = {(x.kind, x.id): x for x in audit.find(clients(), cluster)}
    assert found[("nat-gateway", nat)].usd_per_month == 0.045 * 730
    assert [k for k, _ in found if k == "nat-gateway"] == ["nat-gateway"]  # this cluster's only
    assert found[("vpc-endpoint", endpoint)].usd_per_month == 0.01 * 730
    assert found[("kms-key", key)].usd_per_month == 1.0 and ("kms-key", gone) not in found
    assert found[("dashboard", cluster)].usd_per_month == 3.0
    assert audit.delete(clients(), list(found.values()), log=lambda m: None, pace=audit.Pace(delay=0)) == []
    left = {(x.kind, x.id) for x in audit.find(clients(), cluster)}
    assert not left & {("nat-gateway", nat), ("vpc-endpoint", endpoint), ("kms-key", key), ("dashboard", cluster)}
    assert kms.describe_key(KeyId=key)["KeyMetadata"]["KeyState"] == "PendingDeletion"
    ec2.delete_nat_gateway(NatGatewayId=other)


def stubbed(service):
    client = boto3.client(
        service,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        endpoint_url=f"https://{service}.invalid",
    )
    return client, Stubber(client)


def file_system(fs_id: str, cluster: str) -> dict:
    return {
        "OwnerId": "1",
        "CreationToken": fs_id,
        "FileSystemId": fs_id,
        "CreationTime": "2026-01-01T00:00:00Z",
        "LifeCycleState": "available",
        "NumberOfMountTargets": 1,
        "SizeInBytes": {"Value": 6144},
        "PerformanceMode": "generalPurpose",
        "Tags": [{"Key": "gpu-cluster:name", "Value": cluster}],
    }


def test_every_page_of_file_systems_is_read():
    """DescribeFileSystems returns at most MaxItems (default 100) with NextMarker (EFS API reference)."""
    efs, stubber = stubbed("efs")
    stubber.add_response(
        "describe_file_systems", {"FileSystems": [file_system("fs-other", "x")], "NextMarker": "m2"}, {}
    )
    stubber.add_response("describe_file_systems", {"FileSystems": [file_system("fs-ours", "ours")]}, {"Marker": "m2"})
    with stubber:
        found = audit._file_systems(efs, "ours")
    assert [x.id for x in found] == ["fs-ours"]


def test_a_volume_ec2_is_already_deleting_counts_as_gone():
    """A root volume with DeleteOnTermination goes `deleting` then disappears (EC2 volume states);
    the `volume_available` waiter would wait on it until it timed out."""
    ec2, stubber = stubbed("ec2")
    stubber.add_response(
        "describe_volumes",
        {"Volumes": [{"VolumeId": "vol-1", "State": "deleting"}, {"VolumeId": "vol-2", "State": "available"}]},
        {"Filters": [{"Name": "volume-id", "Values": ["vol-1", "vol-2"]}]},
    )
    stubber.add_response("delete_volume", {}, {"VolumeId": "vol-2"})
    messages = []
    with stubber:
        failed = audit.delete(
            {"ec2": ec2},
            [audit.Leftover("volume", "vol-1", "200 GB in-use", 16.0), audit.Leftover("volume", "vol-2", "1 GB", 0.08)],
            log=messages.append,
            pace=audit.Pace(delay=0),
        )
        stubber.assert_no_pending_responses()
    assert failed == [] and "deleted volume vol-1" in messages and "deleted volume vol-2" in messages


# ---------------------------------------------------------------- issue 28 §8: a stack in DELETE_FAILED


def _failed_stack_cloudformation(cluster: str, then: str = "DELETE_COMPLETE", vpc: str = "vpc-0gone"):
    """CloudFormation after a `cdk destroy` that failed (moto never fails a delete): the stack in DELETE_FAILED
    with its VPC left (`vpc`), then, asked to delete again, `then`."""
    from datetime import datetime, timezone

    cfn = boto3.client("cloudformation", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(cfn)
    stack = {
        "StackName": f"GpuCluster-{cluster}",
        "StackId": f"arn:aws:cloudformation:us-east-1:123456789012:stack/GpuCluster-{cluster}/1",
        "CreationTime": datetime(2026, 11, 1, tzinfo=timezone.utc),
        "StackStatus": "DELETE_FAILED",
        "StackStatusReason": "The following resource(s) failed to delete: [Data]. ",
        "Tags": [{"Key": "gpu-cluster:name", "Value": cluster}],
    }
    stubber.add_response("describe_stacks", {"Stacks": [stack]})  # the refusal's check
    stubber.add_response("describe_stacks", {"Stacks": [stack]})  # the audit's
    left = {
        "LogicalResourceId": "Vpc",
        "PhysicalResourceId": vpc,
        "ResourceType": "AWS::EC2::VPC",
        "LastUpdatedTimestamp": datetime(2026, 11, 1, tzinfo=timezone.utc),
        "ResourceStatus": "DELETE_FAILED",
    }
    stubber.add_response("list_stack_resources", {"StackResourceSummaries": [left]}, {"StackName": stack["StackName"]})
    stubber.add_response("delete_stack", {}, {"StackName": stack["StackName"]})
    stubber.add_response("describe_stacks", {"Stacks": [{**stack, "StackStatus": then}]})  # the waiter
    return cfn, stubber


def test_a_stack_whose_delete_failed_is_listed_and_deleted_after_what_it_left(aws_env):
    """Before: DELETE_FAILED counted as live, so `fab audit --delete` refused ("cdk destroy it first", which had
    just failed) and what the stack could not delete billed on."""
    cluster = f"dfail{uuid.uuid4().hex[:6]}"
    volume = boto3.client("ec2").create_volume(
        AvailabilityZone="us-east-1a", Size=1, TagSpecifications=tagged(cluster, "volume")
    )["VolumeId"]
    cfn, stubber = _failed_stack_cloudformation(cluster)
    with stubber:
        audit.refuse_live_stack(cfn, cluster)  # no refusal
        found = audit.find({**clients(), "cloudformation": cfn}, cluster)
        stack = next(x for x in found if x.kind == "stack")
        assert stack.id == f"GpuCluster-{cluster}" and stack.detail.startswith("DELETE_FAILED (The following")
        lines: list[str] = []
        todo = [x for x in found if x.kind in ("volume", "stack")]
        failed = audit.delete({**clients(), "cloudformation": cfn}, todo, log=lines.append, pace=audit.Pace(delay=0))
        stubber.assert_no_pending_responses()
    assert failed == [] and lines == [f"deleted volume {volume}", f"deleted stack GpuCluster-{cluster}"]


def test_a_stack_that_fails_its_delete_again_is_reported():
    cfn = boto3.client("cloudformation", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(cfn)
    stubber.add_response("delete_stack", {}, {"StackName": "GpuCluster-x"})
    failed_again = {"StackName": "GpuCluster-x", "StackStatus": "DELETE_FAILED"}
    stubber.add_response("describe_stacks", {"Stacks": [{**failed_again, "CreationTime": "2026-11-01T00:00:00Z"}]})
    lines: list[str] = []
    stack = audit.Leftover("stack", "GpuCluster-x", "DELETE_FAILED", 0.0)
    with stubber:
        failed = audit.delete({"cloudformation": cfn}, [stack], log=lines.append, pace=audit.Pace(delay=0))
    assert failed == [stack] and lines[0].startswith("could not delete stack GpuCluster-x: Waiter StackDeleteComplete")


def test_a_failed_stack_names_the_endpoints_in_its_vpc_that_it_did_not_make(aws_env):
    """GuardDuty Runtime Monitoring's automated agent puts a guardduty-data endpoint in the nodes' VPC and
    "doesn't delete the VPC endpoint" (GuardDuty User Guide): the stack's VPC cannot go, and a delete fails again."""
    cluster = f"gdfail{uuid.uuid4().hex[:6]}"
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    guardduty = ec2.create_vpc_endpoint(
        VpcId=vpc,
        ServiceName="com.amazonaws.us-east-1.guardduty-data",
        VpcEndpointType="Interface",
        TagSpecifications=[{"ResourceType": "vpc-endpoint", "Tags": [{"Key": "GuardDutyManaged", "Value": "true"}]}],
    )["VpcEndpoint"]["VpcEndpointId"]
    ours = ec2.create_vpc_endpoint(
        VpcId=vpc,
        ServiceName="com.amazonaws.us-east-1.ssm",
        VpcEndpointType="Interface",
        TagSpecifications=tagged(cluster, "vpc-endpoint"),
    )["VpcEndpoint"]["VpcEndpointId"]
    group = ec2.create_security_group(GroupName="GuardDutyManagedSecurityGroup-x", Description="x", VpcId=vpc)[
        "GroupId"
    ]
    cfn, stubber = _failed_stack_cloudformation(cluster, vpc=vpc)
    with stubber:
        audit.refuse_live_stack(cfn, cluster)
        [stack] = [x for x in audit.find({**clients(), "cloudformation": cfn}, cluster) if x.kind == "stack"]
    assert (
        f"its VPC {vpc} holds what it did not make: endpoints {guardduty} (com.amazonaws.us-east-1.guardduty-data); "
        f"security groups {group} (GuardDutyManagedSecurityGroup-x) (" in stack.detail
    ), stack.detail
    assert (
        ours not in stack.detail
        and "once the endpoint is gone (its interfaces go a minute later), `aws ec2 delete-security-group"
        in stack.detail
    )
