"""The quotas a cluster uses (clusterops/aws/quotas.py): its vCPU bucket, what already runs there and a
request for more, and what a new cluster's VPC takes. EC2 and STS from a moto server; Service Quotas
(which moto lacks) through botocore's Stubber with real response shapes."""

import json

import boto3
import pytest
from aws_stubs import QUOTA_NAME, offline, quotas_client, vpc_quota
from botocore.stub import Stubber
from conftest import REPO, moto_instances
from iampolicy import Request, evaluate

from clusterops.aws import preflight, quotas, redeploy
from stacks.config import ClusterConfig
from stacks.instance_types import INSTANCE_TYPES


@pytest.mark.parametrize(
    "instance_type, on_demand, spot",
    [
        ("g4dn.2xlarge", "L-DB2E81BA", "L-3819A6DF"),
        ("g6e.48xlarge", "L-DB2E81BA", "L-3819A6DF"),
        ("p3.8xlarge", "L-417A185B", "L-7212CCBC"),
        ("p3dn.24xlarge", "L-417A185B", "L-7212CCBC"),
        ("p4d.24xlarge", "L-417A185B", "L-7212CCBC"),
        ("p4de.24xlarge", "L-417A185B", "L-7212CCBC"),
        ("p5.48xlarge", "L-417A185B", "L-C4BD4855"),
    ],
)
def test_each_family_and_purchase_option_maps_to_its_vcpu_quota_bucket(instance_type, on_demand, spot):
    assert quotas.quota_bucket(instance_type)[0] == on_demand
    assert quotas.quota_bucket(instance_type, spot=True)[0] == spot


def test_every_accepted_type_has_a_bucket_for_both_purchase_options():
    for name in INSTANCE_TYPES:
        assert quotas.quota_bucket(name) and quotas.quota_bucket(name, spot=True)


# (moto's instance-type catalogue has no p3 sizes; p4d and p5 stand for the P bucket). A region no
# other test launches in: nothing runs there, so each row takes the path it names (ok or short).
QUIET_REGION = "eu-west-3"


@pytest.mark.parametrize(
    "instance_type, nodes, quota, needed, ok",
    [
        ("g4dn.2xlarge", 4, 16, 32, False),
        ("g4dn.2xlarge", 2, 16, 16, True),
        ("g5.12xlarge", 2, 64, 96, False),
        ("p4d.24xlarge", 2, 192, 192, True),
        ("p5.48xlarge", 1, 96, 192, False),
    ],
)
def test_quota_maths_counts_requested_plus_running_in_the_bucket(aws_env, instance_type, nodes, quota, needed, ok):
    ec2 = boto3.client("ec2", region_name=QUIET_REGION)
    client, stubber = quotas_client(quota, quotas.quota_bucket(instance_type)[0])
    check = quotas.check_quota(ec2, client, instance_type, nodes)
    assert (check.running, check.requested, check.needed, check.ok) == (0, needed, needed, ok)
    assert f"quota {quota:g} vCPUs" in check.line()
    stubber.assert_no_pending_responses()


def test_running_nodes_in_the_bucket_count_against_the_quota(aws_env):
    ec2 = boto3.client("ec2", region_name="eu-west-2")
    client, _ = quotas_client(16)
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, InstanceType="g4dn.xlarge")  # 4 vCPUs, G On-Demand
    check = quotas.check_quota(ec2, client, "g4dn.2xlarge", 2)
    assert (check.running, check.needed, check.ok) == (4, 20, False)


def test_running_vcpus_count_only_the_same_bucket_and_purchase_option(aws_env):
    ec2 = boto3.client("ec2")
    on_demand, spot = (
        quotas.running_vcpus(ec2, "g4dn.2xlarge"),
        quotas.running_vcpus(ec2, "g4dn.2xlarge", spot=True),
    )
    moto_instances(1, instance_type="g5.xlarge")  # 4 vCPUs, G On-Demand
    moto_instances(1, instance_type="m5.large")  # standard bucket
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.run_instances(
        ImageId=image,
        MinCount=1,
        MaxCount=1,
        InstanceType="g5.2xlarge",  # 8 vCPUs, G Spot
        InstanceMarketOptions={"MarketType": "spot"},
    )
    assert quotas.running_vcpus(ec2, "g4dn.2xlarge") == on_demand + 4
    assert quotas.running_vcpus(ec2, "g4dn.2xlarge", spot=True) == spot + 8


def test_a_running_type_outside_the_table_counts_through_a_call_the_user_policy_grants(aws_env):
    """A fresh read (session 30): a g5g node already running (G bucket, not in stacks/instance_types.py) is
    counted from ec2:DescribeInstanceTypes, which docs/user-policy.json did not grant: preflight's quota line read
    "could not read it: AccessDenied" and preflight failed. The action has no resource-level permissions."""
    assert "g5g.xlarge" not in INSTANCE_TYPES
    before = quotas.running_vcpus(boto3.client("ec2"), "g4dn.2xlarge")
    moto_instances(1, instance_type="g5g.xlarge")  # 4 vCPUs, G On-Demand
    assert quotas.running_vcpus(boto3.client("ec2"), "g4dn.2xlarge") == before + 4
    policy = json.loads((REPO / "docs" / "user-policy.json").read_text())
    assert evaluate([policy], Request("ec2:DescribeInstanceTypes", "*", {})).allowed


def test_a_short_quota_is_requested_with_the_exact_number(aws_env):
    ec2 = boto3.client("ec2")
    running = quotas.running_vcpus(ec2, "g4dn.2xlarge")
    client, stubber = quotas_client(8, request=32 + running)
    text = quotas.request_increase(client, quotas.check_quota(ec2, client, "g4dn.2xlarge", 4))
    assert text.startswith(f"requested {QUOTA_NAME} = {32 + running} vCPUs (request req-0123456789, status PENDING)")
    stubber.assert_no_pending_responses()


def test_a_request_already_pending_is_one_line_not_a_traceback():
    client = offline("service-quotas")
    with Stubber(client) as stubber:
        stubber.add_client_error(
            "request_service_quota_increase",
            service_error_code="ResourceAlreadyExistsException",
            service_message="A request for this quota is already pending",
        )
        text = quotas.request_increase(
            client, quotas.QuotaCheck("L-C4BD4855", "All P5 Spot Instance Requests", 0, 0, 192)
        )
    assert "already open" in text and "L-C4BD4855" in text and "\n" not in text


def test_a_region_without_a_vpc_left_fails_preflight_not_the_deploy(aws_env):
    """A new cluster makes its own VPC and internet gateway, and with private_subnet a NAT gateway's Elastic
    IP: 5 each by default (AWS's VPC and EC2 quotas; internet gateways are raised with VPCs but counted
    apart), and a region already at one fails the deploy minutes in, at that resource, and rolls it back.
    Preflight counts what this account owns (a VPC shared by another account counts against the owner's)
    against its quotas; a cluster in an existing VPC needs none."""
    ec2 = boto3.client("ec2")
    account = boto3.client("sts").get_caller_identity()["Account"]
    ec2.create_internet_gateway()  # left detached: it counts
    vpcs = len(ec2.describe_vpcs()["Vpcs"])
    gateways, eips = (
        len(ec2.describe_internet_gateways()["InternetGateways"]),
        len(ec2.describe_addresses()["Addresses"]),
    )
    full = quotas.network_quota(ec2, _network_quotas(vpcs, gateways, eips=None), account, vpc=True, elastic_ip=True)
    assert not full.ok and full.name == "VPC quota"
    assert full.detail.startswith(f"VPCs per Region (L-F678F1CE): {vpcs} of {vpcs} in use, the cluster adds 1; ")
    assert f"; Internet gateways per Region (L-A4707A72): {gateways} of {gateways} in use" in full.detail
    assert f"; EC2-VPC Elastic IPs (L-0263D0A3): {eips} of 5 in use" in full.detail  # AWS's default: none set
    assert full.detail.endswith("or deploy into an existing VPC (-c vpc_id=... -c subnet_id=...)")
    room = quotas.network_quota(ec2, _network_quotas(vpcs + 100, gateways + 100), account, vpc=True, elastic_ip=False)
    assert room.ok and "Elastic IPs" not in room.detail and "none left" not in room.detail
    shared = quotas.network_quota(ec2, _network_quotas(1, 1), "210987654321", vpc=True, elastic_ip=False)  # owns none
    assert shared.ok and shared.detail.startswith("VPCs per Region (L-F678F1CE): 0 of 1 in use"), shared.detail


def test_a_redeploy_counts_only_what_it_adds_to_the_stacks_network(aws_env):
    """The VPC line follows the stack's own resources, not whether a stack exists: a stack that has its VPC
    adds nothing (a private_subnet change is refused by the deployed-cluster line), one whose change set never
    ran adds its VPC, gateway and, in a private subnet, the NAT gateway's Elastic IP; a given VPC none."""
    cfn = boto3.client("cloudformation")
    template = {"Resources": {"Vpc": {"Type": "AWS::EC2::VPC", "Properties": {"CidrBlock": "10.9.0.0/16"}}}}
    cfn.create_stack(StackName="GpuCluster-netcheck", TemplateBody=json.dumps(template))
    clients = {"cloudformation": cfn, "ec2": boto3.client("ec2")}
    found = redeploy.deployed(cfn, clients["ec2"], "GpuCluster-netcheck")
    account = boto3.client("sts").get_caller_identity()["Account"]
    public = ClusterConfig.from_context({})
    assert preflight._network(clients, public, account, found) is None
    private = ClusterConfig.from_context({"access": "ssm", "private_subnet": "true"})
    assert preflight._network(clients, private, account, found) is None
    clients["service-quotas"] = _network_quotas(100, 100, eips=None)
    never_ran = redeploy.Deployed("GpuCluster-netcheck", "REVIEW_IN_PROGRESS", {}, None, resource_types=frozenset())
    line = preflight._network(clients, private, account, never_ran)
    assert line is not None and line.detail.startswith("VPCs per Region (L-F678F1CE): ")
    assert "Elastic IPs" in line.detail
    given = ClusterConfig.from_context(
        {"vpc_id": "vpc-0a1b2c3d", "subnet_id": "subnet-0a1b2c3d", "availability_zone": "us-east-1a"}
    )
    assert preflight._network(clients, given, account, None) is None


def _network_quotas(vpcs: int, gateways: int, eips: int | None = 5, vpc: bool = True):
    """Service Quotas answering VPCs and internet gateways per Region at these values; then (eips None:
    the account has no value of its own) EC2-VPC Elastic IPs through AWS's default of 5."""
    quotas = offline("service-quotas")
    stubber = Stubber(quotas)
    for code, value in (("L-F678F1CE", vpcs), ("L-A4707A72", gateways)) if vpc else ():
        stubber.add_response("get_service_quota", vpc_quota(value, code), {"ServiceCode": "vpc", "QuotaCode": code})
    eip = {"ServiceCode": "ec2", "QuotaCode": "L-0263D0A3"}
    if eips is None:
        stubber.add_client_error("get_service_quota", "NoSuchResourceException", expected_params=eip)
        stubber.add_response("get_aws_default_service_quota", vpc_quota(5, "L-0263D0A3", "ec2"), eip)
    stubber.activate()
    return quotas
