"""ClusterConfig: coercion of `-c` strings, defaults, and one-line errors for bad input."""
import pytest

from stacks.config import ClusterConfig, ConfigError, DEFAULT_AMI_PARAMETER


def test_defaults():
    config = ClusterConfig.from_context({})
    assert (config.nodes, config.instance_type, config.gpus) == (2, "g4dn.2xlarge", 1)
    assert config.ssh_cidr is None and config.retain_data is False and config.placement_group is True
    assert config.ami_ssm_parameter == DEFAULT_AMI_PARAMETER


def test_strings_from_the_command_line_are_coerced():
    config = ClusterConfig.from_context({
        "nodes": "3", "retain_data": "true", "placement_group": "False", "root_volume_gb": " 500 ",
        "ssh_cidr": "203.0.113.0/24", "gpus_per_node": "", "vpc_id": None})
    assert config.nodes == 3 and config.retain_data is True and config.placement_group is False
    assert config.root_volume_gb == 500 and config.ssh_cidr == "203.0.113.0/24"
    assert config.gpus_per_node is None


@pytest.mark.parametrize("instance_type, gpus", [
    ("g4dn.2xlarge", 1), ("g4dn.12xlarge", 4), ("g5.48xlarge", 8), ("p3.8xlarge", 4),
    ("p4d.24xlarge", 8), ("p5.48xlarge", 8), ("G5.XLARGE", 1)])
def test_gpus_per_node_known_for_common_types(instance_type, gpus):
    assert ClusterConfig.from_context({"instance_type": instance_type}).gpus == gpus


def test_gpus_per_node_override_for_an_unlisted_size():
    config = ClusterConfig.from_context({"instance_type": "g5.96xlarge", "gpus_per_node": "8"})
    assert config.gpus == 8


def test_a_bare_address_means_that_one_host():
    assert ClusterConfig.from_context({"ssh_cidr": "203.0.113.7"}).ssh_cidr == "203.0.113.7/32"


def test_world_ssh_needs_explicit_opt_in():
    config = ClusterConfig.from_context({"ssh_cidr": "0.0.0.0/0", "allow_world_ssh": "true"})
    assert config.ssh_cidr == "0.0.0.0/0"


BAD = [
    ("nodes", "0"), ("nodes", "-2"), ("nodes", "two"), ("nodes", "1.5"), ("nodes", "65"),
    ("nodes", True), ("nodes", ""),
    ("instance_type", "m5.large"), ("instance_type", "t3.micro"), ("instance_type", "g4dn"),
    ("instance_type", "g4dn."), ("instance_type", "gpu"), ("instance_type", "g5.96xlarge"),
    ("instance_type", "g5.x!large"),
    ("gpus_per_node", "0"), ("gpus_per_node", "17"), ("gpus_per_node", "many"),
    ("ssh_cidr", "203.0.113.0/33"), ("ssh_cidr", "203.0.113.7/24"), ("ssh_cidr", "300.0.0.0/8"),
    ("ssh_cidr", "0.0.0.0/0"), ("ssh_cidr", "2001:db8::/32"), ("ssh_cidr", "my-laptop"),
    ("allow_world_ssh", "maybe"), ("retain_data", "yes please"), ("placement_group", "2"),
    ("root_volume_gb", "20"), ("root_volume_gb", "lots"), ("root_volume_gb", "20000"),
    ("image", "nvcr.io/nvidia/pytorch"), ("image", "UPPER:case"), ("image", ""),
    ("ami_ssm_parameter", "aws/service/x"), ("ami_ssm_parameter", "ami-12345678"),
    ("vpc_id", "vpc-xyz"), ("subnet_id", "subnet-1"), ("vpc_id", "vpc-0123456789abcdef0"),
    ("availability_zone", "east"), ("availability_zone", "us-east-1a"),
    ("key_name", "bad/name"), ("cluster_name", "My Cluster"), ("cluster_name", "1cluster"),
    ("cluster_name", "a" * 40), ("idle_minutes", "-1"), ("idle_minutes", "soon"),
]


@pytest.mark.parametrize("key, value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_bad_values_are_rejected_with_one_line_naming_key_and_value(key, value):
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_context({key: value})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"invalid config {caught.value.key}=")
    assert caught.value.key == key
    assert "expected" in message or "needs" in message or "go together" in message or "set" in message
