"""Each construct built alone (and the stack composed) for 1, 2 and 8 nodes, asserted with Template + Match."""
import json

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ec2 as ec2
from aws_cdk.assertions import Match, Template

from stacks.cluster_stack import GpuClusterStack
from stacks.config import ClusterConfig
from stacks.network import ClusterNetwork
from stacks.storage import SharedStorage

SSH_CIDR = "203.0.113.0/24"


def _stack() -> cdk.Stack:
    return cdk.Stack(cdk.App(), "Test")


def _cluster(**context) -> Template:
    config = ClusterConfig.from_context({"ssh_cidr": SSH_CIDR, **context})
    return Template.from_stack(GpuClusterStack(cdk.App(), "Cluster", config=config))


@pytest.fixture(scope="module", params=[1, 2, 8], ids=lambda n: f"{n}-nodes")
def cluster(request) -> tuple[int, Template]:
    return request.param, _cluster(nodes=str(request.param))


# ---------------------------------------------------------------- network

def test_network_security_group_allows_all_traffic_only_from_itself_and_ssh_from_cidr():
    stack = _stack()
    network = ClusterNetwork(stack, "Network", ssh_cidr=SSH_CIDR)
    template = Template.from_stack(stack)
    sg_id = stack.resolve(network.security_group.security_group_id)
    template.has_resource_properties("AWS::EC2::SecurityGroupIngress", {
        "IpProtocol": "-1", "SourceSecurityGroupId": sg_id, "GroupId": sg_id})
    ingress = template.find_resources("AWS::EC2::SecurityGroup")
    rules = [r for res in ingress.values() for r in res["Properties"].get("SecurityGroupIngress", [])]
    assert sorted(r["FromPort"] for r in rules) == [22, 4444]
    assert {r["CidrIp"] for r in rules} == {SSH_CIDR}


def test_network_without_ssh_cidr_has_no_cidr_ingress_at_all():
    stack = _stack()
    ClusterNetwork(stack, "Network", ssh_cidr=None)
    rules = [r for res in Template.from_stack(stack).find_resources("AWS::EC2::SecurityGroup").values()
             for r in res["Properties"].get("SecurityGroupIngress", [])]
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


def test_network_can_use_an_existing_vpc_and_subnet():
    stack = _stack()
    network = ClusterNetwork(stack, "Network", ssh_cidr=SSH_CIDR, vpc_id="vpc-0123456789abcdef0",
                             subnet_id="subnet-0123456789abcdef0", availability_zone="us-east-1a")
    template = Template.from_stack(stack)
    template.resource_count_is("AWS::EC2::VPC", 0)
    template.has_resource_properties("AWS::EC2::SecurityGroup", {"VpcId": "vpc-0123456789abcdef0"})
    assert network.subnet.subnet_id == "subnet-0123456789abcdef0"


# ---------------------------------------------------------------- storage

def _storage(retain: bool) -> Template:
    stack = _stack()
    vpc = ec2.Vpc(stack, "Vpc", max_azs=1, nat_gateways=0, subnet_configuration=[
        ec2.SubnetConfiguration(name="p", subnet_type=ec2.SubnetType.PUBLIC)])
    clients = ec2.SecurityGroup(stack, "Clients", vpc=vpc)
    SharedStorage(stack, "Storage", vpc=vpc, subnet=vpc.public_subnets[0],
                  client_security_group=clients, retain_data=retain)
    return Template.from_stack(stack)


def test_storage_is_encrypted_elastic_efs_with_one_mount_target_and_nfs_from_clients_only():
    template = _storage(retain=False)
    template.has_resource_properties("AWS::EFS::FileSystem", {
        "Encrypted": True, "ThroughputMode": "elastic", "PerformanceMode": "generalPurpose"})
    template.resource_count_is("AWS::EFS::MountTarget", 1)
    template.has_resource_properties("AWS::EC2::SecurityGroupIngress", {
        "IpProtocol": "tcp", "FromPort": 2049, "ToPort": 2049,
        "SourceSecurityGroupId": Match.any_value()})
    efs_sg = [r for r in template.find_resources("AWS::EC2::SecurityGroup").values()
              if "EFS" in r["Properties"]["GroupDescription"]]
    assert efs_sg and "SecurityGroupIngress" not in efs_sg[0]["Properties"]


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
    template.has_resource_properties("AWS::EC2::LaunchTemplate", {"LaunchTemplateData": {
        "MetadataOptions": {"HttpTokens": "required"}}})
    template.has_resource_properties("AWS::EC2::Instance", {"BlockDeviceMappings": [{
        "DeviceName": "/dev/sda1", "Ebs": {"VolumeType": "gp3", "Encrypted": True,
                                           "DeleteOnTermination": True, "VolumeSize": 200}}]})


def test_nodes_wait_for_their_bootstrap_signal_and_are_tagged_with_rank(cluster):
    nodes, template = cluster
    instances = template.find_resources("AWS::EC2::Instance")
    for resource in instances.values():
        assert resource["CreationPolicy"]["ResourceSignal"] == {"Count": 1, "Timeout": "PT45M"}
    ranks = sorted(int(t["Value"]) for i in instances.values() for t in i["Properties"]["Tags"]
                   if t["Key"] == "gpu-cluster:rank")
    assert ranks == list(range(nodes))


def test_no_ingress_from_the_world_and_a_self_referencing_rule(cluster):
    _, template = cluster
    for sg in template.find_resources("AWS::EC2::SecurityGroup").values():
        for rule in sg["Properties"].get("SecurityGroupIngress", []):
            assert rule.get("CidrIp") == SSH_CIDR
    template.has_resource_properties("AWS::EC2::SecurityGroupIngress", {"IpProtocol": "-1"})


def test_world_ssh_appears_only_with_the_opt_in():
    template = _cluster(ssh_cidr="0.0.0.0/0", allow_world_ssh="true")
    rules = [r for sg in template.find_resources("AWS::EC2::SecurityGroup").values()
             for r in sg["Properties"].get("SecurityGroupIngress", [])]
    assert {r["CidrIp"] for r in rules} == {"0.0.0.0/0"} and {r["FromPort"] for r in rules} == {22, 4444}


def _user_data(template: Template, rank: int) -> str:
    instance = [i for i in template.find_resources("AWS::EC2::Instance").values()
                if {"Key": "gpu-cluster:rank", "Value": str(rank)} in i["Properties"]["Tags"]][0]
    parts = instance["Properties"]["UserData"]["Fn::Base64"]
    if isinstance(parts, str):
        return parts
    return "".join(p if isinstance(p, str) else "<token>" for p in parts["Fn::Join"][1])


def test_user_data_carries_the_bootstrap_with_its_config(cluster):
    nodes, template = cluster
    text = _user_data(template, nodes - 1)
    assert text.startswith("#!/bin/bash")
    assert f"NODE_RANK={nodes - 1}\n" in text and f"NODES={nodes}\n" in text
    assert "nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport,_netdev" in text
    assert ">> /etc/fstab" in text
    assert "--gpus all --net=host --ipc=host" in text and "gpu-cluster-train" in text
    assert "signal-resource" in text and "http-tokens" not in text
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
    template = _cluster()
    policies = template.find_resources("AWS::IAM::Policy")
    statements = [s for p in policies.values() for s in p["Properties"]["PolicyDocument"]["Statement"]]
    actions = sorted(a for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))
    assert "cloudformation:SignalResource" in actions and "ssm:PutParameter" in actions
    assert all("*" not in a for a in actions if not a.startswith("logs:"))
    template.has_resource_properties("AWS::IAM::Role", {"ManagedPolicyArns": [
        Match.object_like({"Fn::Join": Match.array_with([Match.array_with([
            ":iam::aws:policy/AmazonSSMManagedInstanceCore"])])})]})


def test_the_stack_creates_a_key_pair_whose_private_key_is_in_ssm_unless_one_is_named():
    generated = _cluster()
    generated.resource_count_is("AWS::EC2::KeyPair", 1)
    generated.has_output("KeyParameterName", {"Value": {"Fn::Join": ["", ["/ec2/keypair/", Match.any_value()]]}})
    named = _cluster(key_name="my-key")
    named.resource_count_is("AWS::EC2::KeyPair", 0)
    named.has_output("KeyParameterName", {"Value": "none"})
    named.has_resource_properties("AWS::EC2::Instance", {"KeyName": "my-key"})


def test_outputs_for_the_fab_tasks(cluster):
    nodes, template = cluster
    outputs = template.find_outputs("*")
    for key in ("HeadPublicIp", "PrivateIps", "PublicIps", "InstanceIds", "FileSystemId",
                "KeyParameterName", "HostKeyParameterName", "Region", "GpusPerNode"):
        assert key in outputs, key
    value = outputs["PrivateIps"]["Value"]
    items = value["Fn::Join"][1] if "Fn::Join" in value else [value]  # one node: no join
    assert [item["Fn::GetAtt"][1] for item in items] == ["PrivateIp"] * nodes
    assert outputs["GpusPerNode"]["Value"] == "1"


def test_placement_group_can_be_turned_off():
    template = _cluster(placement_group="false")
    template.resource_count_is("AWS::EC2::PlacementGroup", 0)
