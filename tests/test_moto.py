"""`cdk deploy` of the app into a moto server (a real HTTP AWS emulator), then boto3 and the fab
inventory find the stack's nodes and outputs. moto lacks placement groups and AWS::EC2::KeyPair in
CloudFormation, and AWS::KMS::Key there, so this deploy uses placement_group=false, an existing key
pair and flow_logs=false (the flow log's key); the template tests cover them."""

import subprocess
from pathlib import Path

import boto3
import pytest
from conftest import REPO, environment, tool_env
from moto_deploy import PINNED_AMI, app_copy, deploy

from clusterops.inventory import (
    Inventory,
    InventoryError,
    from_outputs,
    stack_outputs_from_aws,
    stack_outputs_from_file,
)

# One xdist worker takes the whole module: the deploy fixture (23 s) is built once, not per worker.
pytestmark = pytest.mark.xdist_group("moto-deploy")

STACK = "GpuCluster-gpu-cluster"
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyPublishedByRankZero gpu-cluster-host"


@pytest.fixture(scope="module")
def deployed(moto_env, tmp_path_factory):
    """The stack deployed once for the module; the moto variables are set while it lasts."""
    with environment(moto_env):
        yield _deploy(moto_env, tmp_path_factory)


def _deploy(aws_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("deploy")
    context = {"nodes": "2", "ssh_cidr": "203.0.113.0/24", "key_name": "test-key"}
    deploy(aws_env, work, context)
    return work, work / "test-key.pem"


def test_the_outputs_file_names_every_node_and_the_file_system(deployed):
    work, _ = deployed
    name, outputs = stack_outputs_from_file(work / "cdk-outputs.json")
    assert name == STACK
    ids = outputs["InstanceIds"].split(",")
    assert len(ids) == len(outputs["PrivateIps"].split(",")) == 2
    reservations = boto3.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
    instances = {i["InstanceId"]: i for r in reservations for i in r["Instances"]}
    for rank, instance_id in enumerate(ids):
        instance = instances[instance_id]
        tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
        assert tags["gpu-cluster:rank"] == str(rank) and tags["gpu-cluster:name"] == "gpu-cluster"
        assert instance["InstanceType"] == "g4dn.2xlarge" and instance["KeyName"] == "test-key"
        assert instance["ImageId"] == PINNED_AMI and instance["Placement"]["AvailabilityZone"] == "us-east-1b"
        assert instance["PrivateIpAddress"] == outputs["PrivateIps"].split(",")[rank]
    assert len({i["SubnetId"] for i in instances.values()}) == 1
    file_system = boto3.client("efs").describe_file_systems(FileSystemId=outputs["FileSystemId"])["FileSystems"][0]
    assert file_system["Encrypted"] is True


def test_security_group_in_the_emulator_has_no_world_ingress(deployed):
    groups = boto3.client("ec2").describe_security_groups(
        Filters=[{"Name": "tag:gpu-cluster:name", "Values": ["gpu-cluster"]}]
    )["SecurityGroups"]
    node_groups = [g for g in groups if "GPU cluster nodes" in g["Description"]]
    assert len(node_groups) == 1
    permissions = node_groups[0]["IpPermissions"]
    cidrs = {r["CidrIp"] for p in permissions for r in p.get("IpRanges", [])}
    assert cidrs == {"203.0.113.0/24"}
    assert {(p["FromPort"], p["ToPort"]) for p in permissions if p.get("IpRanges")} == {(4444, 4444)}
    assert any(p["IpProtocol"] == "-1" and p.get("UserIdGroupPairs") for p in permissions)


def test_inventory_from_the_outputs_file_and_from_describe_stacks_agree(deployed, tmp_path):
    work, key_file = deployed
    ssm = boto3.client("ssm")
    placeholder = ssm.get_parameter(Name="/gpu-cluster/gpu-cluster/ssh-host-key")["Parameter"]["Value"]
    assert placeholder.startswith("pending")  # created by the stack, so `cdk destroy` removes it
    with pytest.raises(InventoryError, match="not published their host key yet"):
        name, outputs = stack_outputs_from_file(work / "cdk-outputs.json")
        from_outputs(name, outputs, boto3.session.Session(), tmp_path / "keys", key_file=str(key_file))
    # What rank 0's bootstrap does once the cluster identity exists:
    ssm.put_parameter(Name="/gpu-cluster/gpu-cluster/ssh-host-key", Value=HOST_KEY, Type="String", Overwrite=True)
    name, outputs = stack_outputs_from_file(work / "cdk-outputs.json")
    from_file = from_outputs(name, outputs, boto3.session.Session(), tmp_path / "keys", key_file=str(key_file))
    from_api = from_outputs(
        STACK,
        stack_outputs_from_aws(STACK, boto3.session.Session()),
        boto3.session.Session(),
        tmp_path / "keys2",
        key_file=str(key_file),
    )
    assert from_file.extra["dashboard_url"] == from_api.extra["dashboard_url"]
    assert from_file.extra["dashboard_url"].endswith(
        "cloudwatch/home?region=us-east-1#dashboards:name=gpu-cluster-us-east-1"
    )
    assert [n.private_ip for n in from_file.nodes] == outputs["PrivateIps"].split(",")
    assert from_file.nodes == from_api.nodes and from_file.gpus_per_node == 1
    known_hosts = Path(from_file.ssh.known_hosts).read_text().splitlines()
    assert known_hosts == [f"[{ip}]:4444 {' '.join(HOST_KEY.split()[:2])}" for ip in outputs["PrivateIps"].split(",")]
    assert oct(Path(from_file.ssh.known_hosts).stat().st_mode & 0o777) == "0o600"


def test_generated_private_key_is_fetched_from_ssm_once_per_deploy_with_0600(deployed, tmp_path):
    work, _ = deployed
    name, outputs = stack_outputs_from_file(work / "cdk-outputs.json")
    ssm = boto3.client("ssm")
    ssm.put_parameter(
        Name="/ec2/keypair/key-0abc",
        Value="-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----",
        Type="SecureString",
        Overwrite=True,
    )
    ssm.put_parameter(Name="/gpu-cluster/gpu-cluster/ssh-host-key", Value=HOST_KEY, Type="String", Overwrite=True)
    generated = dict(outputs, KeyParameterName="/ec2/keypair/key-0abc")
    inventory = from_outputs(name, generated, boto3.session.Session(), tmp_path / "state", key_dir=tmp_path / "ssh")
    key = Path(inventory.ssh.key_file)
    assert key.parent == tmp_path / "ssh"
    assert key.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----") and key.read_text().endswith("\n")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    ssm.delete_parameter(Name="/ec2/keypair/key-0abc")
    again = from_outputs(
        name, generated, boto3.session.Session(), tmp_path / "state", key_dir=tmp_path / "ssh"
    )  # no second fetch
    assert again.ssh.key_file == str(key)
    # `cdk destroy` then a new deploy: the same stack name, a new key pair and parameter.
    ssm.put_parameter(
        Name="/ec2/keypair/key-0def",
        Value="-----BEGIN OPENSSH PRIVATE KEY-----\nnew\n-----END OPENSSH PRIVATE KEY-----",
        Type="SecureString",
        Overwrite=True,
    )
    redeployed = from_outputs(
        name,
        dict(outputs, KeyParameterName="/ec2/keypair/key-0def"),
        boto3.session.Session(),
        tmp_path / "state",
        key_dir=tmp_path / "ssh",
    )
    assert "\nnew\n" in Path(redeployed.ssh.key_file).read_text(), "the old deploy's key was reused"
    with pytest.raises(InventoryError, match="--key-file"):
        from_outputs(name, outputs, boto3.session.Session(), tmp_path / "keys3")


def test_fab_inventory_task_writes_the_inventory(deployed, tmp_path, aws_env):
    work, key_file = deployed
    boto3.client("ssm").put_parameter(
        Name="/gpu-cluster/gpu-cluster/ssh-host-key", Value=HOST_KEY, Type="String", Overwrite=True
    )
    target = tmp_path / "inventory.json"
    result = subprocess.run(
        ["fab", "inventory", "--outputs", str(work / "cdk-outputs.json"), "--key-file", str(key_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(target), **aws_env),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    inventory = Inventory.load(target)
    assert inventory.source == "aws" and len(inventory.nodes) == 2 and inventory.stack_name == STACK
    fallback = subprocess.run(
        ["fab", "inventory", "--stack", STACK, "--outputs", str(tmp_path / "nope.json"), "--key-file", str(key_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "fallback.json"), **aws_env),
        timeout=60,
    )
    assert fallback.returncode == 0 and "describing stack" in fallback.stdout, fallback.stderr
    assert Inventory.load(tmp_path / "fallback.json").nodes == inventory.nodes
    missing = subprocess.run(
        ["fab", "inventory", "--outputs", str(tmp_path / "nope.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=tool_env(**aws_env),
        timeout=60,
    )
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines()[-1].startswith("error: no ") and "cdk deploy" in missing.stderr


def test_the_node_config_names_the_bootstrap_script_the_deploy_uploaded(deployed):
    """What each node's user-data stub fetches: the node-config parameter's BOOTSTRAP_URL is the script
    itself, uploaded by `cdk deploy` as its own asset; the base image and Spot are beside it."""
    value = boto3.client("ssm").get_parameter(Name="/gpu-cluster/gpu-cluster/node-config")["Parameter"]["Value"]
    config = dict(line.split("=", 1) for line in value.splitlines())
    assert set(config) == {"BOOTSTRAP_URL", "BASE_IMAGE", "EFA_CARDS", "SPOT"} and config["SPOT"] == "false"
    bucket, key = config["BOOTSTRAP_URL"].removeprefix("s3://").split("/", 1)
    body = boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    assert body == (REPO / "assets" / "bootstrap" / "node-bootstrap.sh").read_bytes()


def test_fab_destroy_runs_the_real_cdk_destroy_from_the_inventory_alone(deployed, tmp_path, aws_env):
    """Last in this module: it destroys the module's stack. Its nodes are moto's (no sshd: /data cannot be
    read), so --yes. The pinned CLI finds the stack by the inventory's stack and cluster names alone (the app
    runs for destroy too, without the deploy's -c values). moto's CloudFormation deletes the VPC before what
    it holds (its terminated instances keep their network interfaces, the internet gateway stays attached):
    its delete fails where AWS's does not, so the test takes either outcome and asserts the one line a
    failure gives."""
    work, key_file = deployed
    boto3.client("ssm").put_parameter(
        Name="/gpu-cluster/gpu-cluster/ssh-host-key", Value=HOST_KEY, Type="String", Overwrite=True
    )
    env = tool_env(
        GPU_CLUSTER_INVENTORY=str(tmp_path / "inventory.json"), GPU_CLUSTER_CDK_APP=str(app_copy(tmp_path)), **aws_env
    )
    fab = ["fab", "inventory", "--outputs", str(work / "cdk-outputs.json"), "--key-file", str(key_file)]
    subprocess.run(fab, cwd=REPO, env=env, check=True, capture_output=True, timeout=60)
    done = subprocess.run(["fab", "destroy", "--yes"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert f"cdk destroy {STACK} --force -c cluster_name=gpu-cluster -c stack_name={STACK}\n" in done.stdout, (
        done.stdout + done.stderr
    )
    assert f"{STACK}: destroying..." in done.stdout + done.stderr  # the app synthesized it for destroy
    if done.returncode:
        assert done.stderr.strip().splitlines()[-1].startswith(f"error: `cdk destroy` did not delete {STACK} (")
    else:
        assert done.stdout.strip().splitlines()[-1].startswith(f"destroyed {STACK}: `fab audit` lists anything left")
