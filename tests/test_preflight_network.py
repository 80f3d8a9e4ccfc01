"""fab preflight's checks of a given VPC and subnet (-c vpc_id, -c subnet_id): the DNS the EFS mount by name
needs and the boot's way out, against moto's VPCs, gateways and route tables (botocore's Stubber where moto
differs from AWS), with the documented user policy's permission for each read."""

import json
import shlex
import subprocess

import boto3
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
    bare = preflight.subnet_route_out(ec2, private, public_ip_requested=False)
    assert not bare.ok and "has no working default route (0.0.0.0/0)" in bare.detail, bare
    gateway = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=gateway, VpcId=vpc)
    main = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["RouteTables"][0]["RouteTableId"]
    ec2.create_route(RouteTableId=main, DestinationCidrBlock="0.0.0.0/0", GatewayId=gateway)
    assert preflight.subnet_route_out(ec2, public, public_ip_requested=True).ok  # ssh: the main table's IGW
    ssm = preflight.subnet_route_out(ec2, public, public_ip_requested=False)
    assert not ssm.ok and f"through {gateway} but gives no public IP (access=ssm)" in ssm.detail, ssm
    ec2.modify_subnet_attribute(SubnetId=public, MapPublicIpOnLaunch={"Value": True})
    assert preflight.subnet_route_out(ec2, public, public_ip_requested=False).ok
    address = ec2.allocate_address(Domain="vpc")["AllocationId"]
    nat = ec2.create_nat_gateway(SubnetId=public, AllocationId=address)["NatGateway"]["NatGatewayId"]
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.create_route(RouteTableId=table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat)
    ec2.associate_route_table(RouteTableId=table, SubnetId=private)
    assert preflight.subnet_route_out(ec2, private, public_ip_requested=False).ok
    ssh = preflight.subnet_route_out(ec2, private, public_ip_requested=True)
    assert not ssh.ok and f"through {nat}, a private subnet's way" in ssh.detail, ssh
    # A deleted NAT gateway leaves its route, a blackhole (moto keeps it active): botocore's shapes.
    stubbed = offline("ec2")
    route = {"DestinationCidrBlock": "0.0.0.0/0", "NatGatewayId": nat, "State": "blackhole"}
    with Stubber(stubbed) as stub:
        stub.add_response("describe_subnets", {"Subnets": [{"SubnetId": private, "VpcId": vpc}]})
        stub.add_response("describe_route_tables", {"RouteTables": [{"RouteTableId": table, "Routes": [route]}]})
        blackhole = preflight.subnet_route_out(stubbed, private, public_ip_requested=False)
    assert not blackhole.ok and "has no working default route" in blackhole.detail, blackhole
    policy = json.loads((REPO / "docs" / "user-policy.json").read_text())
    for action in ("ec2:DescribeSubnets", "ec2:DescribeRouteTables"):
        assert evaluate([policy], Request(action, "*")).allowed, action
