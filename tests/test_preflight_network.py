"""fab preflight's checks of a given VPC and subnet (-c vpc_id, -c subnet_id): the DNS the EFS mount by name
needs and the boot's way out, against moto's VPCs, gateways and route tables (botocore's Stubber where moto
differs from AWS), with the documented user policy's permission for each read."""

import json
import shlex
import subprocess

import boto3
import pytest
from aws_stubs import offline
from botocore.stub import Stubber
from conftest import REPO, tool_env
from iampolicy import Request, evaluate

from clusterops.aws import preflight


def test_a_given_vpc_without_dns_hostnames_fails_preflight_with_the_command_that_fixes_it(aws_env):
    """EFS is mounted by its DNS name, which needs the VPC's DNS resolution and hostnames (a new VPC has
    hostnames off): the check names the attribute and the command; that command, run by the real AWS CLI,
    turns it on; the documented user policy lets preflight read the attributes."""
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.77.0.0/16")["Vpc"]["VpcId"]
    off = preflight.vpc_dns(ec2, vpc)
    assert not off.ok and off.name == "VPC DNS" and "enableDnsHostnames off" in off.detail, off
    assert "enableDnsSupport" not in off.detail and "\n" not in off.detail
    command = off.detail.split("; ", 1)[1]
    assert command == f"aws ec2 modify-vpc-attribute --vpc-id {vpc} --enable-dns-hostnames"
    subprocess.run(shlex.split(command), env=tool_env(**aws_env), check=True, capture_output=True)
    assert preflight.vpc_dns(ec2, vpc).ok
    policy = json.loads((REPO / "docs" / "user-policy.json").read_text())
    assert evaluate([policy], Request("ec2:DescribeVpcAttribute", "*")).allowed


def default_vpc_way_out(ec2, vpc: str) -> None:
    """What AWS's default VPC has and moto's lacks: an internet gateway, the main route table's 0.0.0.0/0 to
    it (VPC User Guide, "Default VPCs")."""
    main = ec2.describe_route_tables(
        Filters=[{"Name": "vpc-id", "Values": [vpc]}, {"Name": "association.main", "Values": ["true"]}]
    )["RouteTables"][0]
    if any(r.get("DestinationCidrBlock") == "0.0.0.0/0" for r in main["Routes"]):
        return
    gateway = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=gateway, VpcId=vpc)
    ec2.create_route(RouteTableId=main["RouteTableId"], DestinationCidrBlock="0.0.0.0/0", GatewayId=gateway)


def test_a_given_subnet_without_a_way_out_for_its_nodes_fails_preflight(aws_env):
    """Every boot fetches from SSM, S3 and nvcr.io: a given subnet needs a default route, to an internet
    gateway with a public IP on the node (access=ssh asks for one; with ssm the subnet's auto-assign
    decides) or to a NAT gateway (ssm only: fab reaches ssh nodes at their public IPs). moto's VPC, subnets,
    gateways and route tables; a subnet without its own table uses the VPC's main one."""
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.78.0.0/16")["Vpc"]["VpcId"]
    public, private = (ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.78.{i}.0/24")["Subnet"]["SubnetId"] for i in (1, 2))
    bare = preflight.subnet_route_out(ec2, private, None)
    assert not bare.ok and "has no working default route (0.0.0.0/0)" in bare.detail, bare
    gateway = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=gateway, VpcId=vpc)
    main = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["RouteTables"][0]["RouteTableId"]
    ec2.create_route(RouteTableId=main, DestinationCidrBlock="0.0.0.0/0", GatewayId=gateway)
    assert preflight.subnet_route_out(ec2, public, True).ok  # ssh: the main table's internet gateway
    ssm = preflight.subnet_route_out(ec2, public, None)
    assert not ssm.ok and f"through {gateway} but its nodes get no public IP" in ssm.detail, ssm
    ec2.modify_subnet_attribute(SubnetId=public, MapPublicIpOnLaunch={"Value": True})
    assert preflight.subnet_route_out(ec2, public, None).ok
    assert not preflight.subnet_route_out(ec2, public, False).ok  # several EFA cards: no public IP at all
    address = ec2.allocate_address(Domain="vpc")["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=public, AllocationId=address)["NatGateway"]["NatGatewayId"]
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat)
    ec2.associate_route_table(RouteTableId=table, SubnetId=private)
    assert preflight.subnet_route_out(ec2, private, None).ok and preflight.subnet_route_out(ec2, private, False).ok
    ssh = preflight.subnet_route_out(ec2, private, True)
    assert not ssh.ok and f"through {nat}, not an internet gateway" in ssh.detail, ssh
    policy = json.loads((REPO / "docs" / "user-policy.json").read_text())
    for action in ("ec2:DescribeSubnets", "ec2:DescribeRouteTables", "ec2:DescribeVpcEndpoints"):
        assert evaluate([policy], Request(action, "*")).allowed, action


def _routes(route: dict) -> dict:
    """A describe_route_tables answer: one table whose default route is `route` (active unless it says)."""
    default = {"DestinationCidrBlock": "0.0.0.0/0", "State": "active", **route}
    return {"RouteTables": [{"RouteTableId": "rtb-1", "Routes": [default]}]}


FIREWALL = {"GatewayId": "vpce-0f1"}  # a Network Firewall endpoint, in subnet-fw
# (the subnet's default route, the firewall subnet's or None, ssh's verdict, ssm's without a public IP)
ROUTES = {
    "NAT gateway": ({"NatGatewayId": "nat-1"}, None, False, True),
    "a deleted NAT gateway (blackhole)": ({"NatGatewayId": "nat-1", "State": "blackhole"}, None, False, False),
    "transit gateway": ({"TransitGatewayId": "tgw-1"}, None, False, True),
    "NAT instance": ({"InstanceId": "i-1", "InstanceOwnerId": "1", "NetworkInterfaceId": "eni-1"}, None, False, True),
    "peering connection": ({"VpcPeeringConnectionId": "pcx-1"}, None, False, False),
    "firewall, then internet gateway": (FIREWALL, {"GatewayId": "igw-1"}, True, False),
    "firewall, then NAT gateway": (FIREWALL, {"NatGatewayId": "nat-1"}, False, True),
}


@pytest.mark.parametrize("name", ROUTES)
def test_each_kind_of_default_route_passes_only_where_a_node_can_get_out(name):
    """botocore's Route shapes for what moto cannot show: the verdict on the last hop, a firewall endpoint
    followed to its own subnet's route; the subnet's own table looked up by association.subnet-id."""
    first, beyond, ssh_ok, ssm_ok = ROUTES[name]
    for public_ip, expected in ((True, ssh_ok), (False, ssm_ok)):
        ec2 = offline("ec2")
        with Stubber(ec2) as stub:
            stub.add_response("describe_subnets", {"Subnets": [{"SubnetId": "subnet-1", "VpcId": "vpc-1"}]})
            by_subnet = {"Filters": [{"Name": "association.subnet-id", "Values": ["subnet-1"]}]}
            stub.add_response("describe_route_tables", _routes(first), by_subnet)
            if beyond is not None:
                stub.add_response("describe_vpc_endpoints", {"VpcEndpoints": [{"SubnetIds": ["subnet-fw"]}]})
                stub.add_response("describe_route_tables", _routes(beyond))
            found = preflight.subnet_route_out(ec2, "subnet-1", public_ip)
            stub.assert_no_pending_responses()
        assert found.ok == expected, (name, public_ip, found.detail)


def test_a_shared_vpcs_subnet_whose_route_tables_are_the_owners_is_not_checked():
    """A participant in a shared VPC sees the subnet, not the owner's route tables (VPC User Guide, "Share
    your VPC with other accounts"): both lookups come back empty; the check says so instead of failing."""
    ec2 = offline("ec2")
    with Stubber(ec2) as stub:
        stub.add_response("describe_subnets", {"Subnets": [{"SubnetId": "subnet-1", "VpcId": "vpc-1"}]})
        stub.add_response("describe_route_tables", {"RouteTables": []})
        main = [{"Name": "vpc-id", "Values": ["vpc-1"]}, {"Name": "association.main", "Values": ["true"]}]
        stub.add_response("describe_route_tables", {"RouteTables": []}, {"Filters": main})
        found = preflight.subnet_route_out(ec2, "subnet-1", None)
    assert found.ok and found.skipped and "no route table of subnet-1 is visible" in found.detail
