"""ClusterConfig: coercion of `-c` strings, defaults, and one-line errors for bad input."""

import pytest

from stacks.config import MAX_IDLE_MINUTES, ClusterConfig, ConfigError, choose_availability_zone, offerings_context_key
from stacks.instance_types import AMI_PARAMETERS, INSTANCE_TYPES


def test_defaults():
    config = ClusterConfig.from_context({})
    assert (config.nodes, config.instance_type, config.gpus) == (2, "g4dn.2xlarge", 1)
    assert config.ssh_cidr is None and config.retain_data is False and config.in_placement_group is True
    assert config.ami_parameter == AMI_PARAMETERS["oss"]


@pytest.mark.parametrize("name", sorted(INSTANCE_TYPES))
def test_every_accepted_type_has_its_facts_and_a_supported_ami(name):
    facts = INSTANCE_TYPES[name]
    config = ClusterConfig.from_context({"instance_type": name})
    assert config.gpus == facts.gpus >= 1 and facts.vcpus >= 4 * facts.gpus
    assert facts.gpu_memory_gib >= 16 and 0 <= facts.efa <= 32
    # The Base OSS-driver DLAMI lists no V100 type; the proprietary-driver one drives them.
    expected = "proprietary" if facts.gpu == "V100" else "oss"
    assert config.ami_parameter == AMI_PARAMETERS[expected]


@pytest.mark.parametrize("instance_type", ["p3.2xlarge", "p3dn.24xlarge"])
def test_a_v100_type_with_the_oss_driver_ami_is_refused_in_one_line(instance_type):
    with pytest.raises(ConfigError, match="does not support p3") as caught:
        ClusterConfig.from_context({"instance_type": instance_type, "ami_ssm_parameter": AMI_PARAMETERS["oss"]})
    assert caught.value.key == "ami_ssm_parameter" and "\n" not in str(caught.value)


def test_the_az_is_one_that_offers_the_type_unless_one_is_given():
    key = offerings_context_key("us-east-1", "p4d.24xlarge")
    context = {"instance_type": "p4d.24xlarge", key: ["us-east-1f", "us-east-1c"]}
    assert ClusterConfig.from_context(context, region="us-east-1").availability_zone == "us-east-1c"
    explicit = ClusterConfig.from_context({**context, "availability_zone": "us-east-1a"}, region="us-east-1")
    assert explicit.availability_zone == "us-east-1a"
    assert ClusterConfig.from_context(context, region="eu-west-1").availability_zone is None
    assert choose_availability_zone(None, []) is None


def test_idle_minutes_stop_at_what_a_cloudwatch_alarm_accepts():
    assert ClusterConfig.from_context({"idle_minutes": str(MAX_IDLE_MINUTES)}).idle_minutes == MAX_IDLE_MINUTES
    with pytest.raises(ConfigError, match="idle_minutes"):
        ClusterConfig.from_context({"idle_minutes": str(MAX_IDLE_MINUTES + 1)})


def test_strings_from_the_command_line_are_coerced():
    config = ClusterConfig.from_context(
        {
            "nodes": "3",
            "retain_data": "true",
            "placement_group": "False",
            "root_volume_gb": " 500 ",
            "ssh_cidr": "203.0.113.0/24",
            "gpus_per_node": "",
            "vpc_id": None,
        }
    )
    assert config.nodes == 3 and config.retain_data is True and config.placement_group is False
    assert config.root_volume_gb == 500 and config.ssh_cidr == "203.0.113.0/24"
    assert config.gpus_per_node is None


@pytest.mark.parametrize(
    "instance_type, gpus",
    [
        ("g4dn.2xlarge", 1),
        ("g4dn.12xlarge", 4),
        ("g5.48xlarge", 8),
        ("p3.8xlarge", 4),
        ("p4d.24xlarge", 8),
        ("p5.48xlarge", 8),
        ("G5.XLARGE", 1),
    ],
)
def test_gpus_per_node_known_for_common_types(instance_type, gpus):
    assert ClusterConfig.from_context({"instance_type": instance_type}).gpus == gpus


def test_gpus_per_node_override_uses_fewer_ranks():
    config = ClusterConfig.from_context({"instance_type": "g5.48xlarge", "gpus_per_node": "4"})
    assert config.gpus == 4


def test_more_ranks_per_node_than_the_type_has_gpus_is_refused_in_one_line():
    """Two ranks on one GPU: NCCL's first collective fails every rank ("Duplicate GPU detected")."""
    with pytest.raises(ConfigError, match=r"gpus_per_node.*g5\.12xlarge has 4 GPU\(s\): one rank per GPU, at most 4"):
        ClusterConfig.from_context({"instance_type": "g5.12xlarge", "gpus_per_node": "8"})


def test_a_bare_address_means_that_one_host():
    assert ClusterConfig.from_context({"ssh_cidr": "203.0.113.7"}).ssh_cidr == "203.0.113.7/32"


def test_world_ssh_needs_explicit_opt_in():
    config = ClusterConfig.from_context({"ssh_cidr": "0.0.0.0/0", "allow_world_ssh": "true"})
    assert config.ssh_cidr == "0.0.0.0/0"


BAD = [
    ("nodes", "0"),
    ("nodes", "-2"),
    ("nodes", "two"),
    ("nodes", "1.5"),
    ("nodes", "65"),
    ("nodes", True),
    ("nodes", ""),
    ("instance_type", "m5.large"),
    ("instance_type", "t3.micro"),
    ("instance_type", "g4dn"),
    ("instance_type", "g4dn."),
    ("instance_type", "gpu"),
    ("instance_type", "g5.96xlarge"),
    ("instance_type", "g5.x!large"),
    ("gpus_per_node", "0"),
    ("gpus_per_node", "17"),
    ("gpus_per_node", "many"),
    ("ssh_cidr", "203.0.113.0/33"),
    ("ssh_cidr", "203.0.113.7/24"),
    ("ssh_cidr", "300.0.0.0/8"),
    ("ssh_cidr", "0.0.0.0/0"),
    ("ssh_cidr", "2001:db8::/32"),
    ("ssh_cidr", "my-laptop"),
    ("allow_world_ssh", "maybe"),
    ("retain_data", "yes please"),
    ("placement_group", "2"),
    ("root_volume_gb", "20"),
    ("root_volume_gb", "lots"),
    ("root_volume_gb", "20000"),
    ("image", "nvcr.io/nvidia/pytorch"),
    ("image", "UPPER:case"),
    ("image", ""),
    ("image", "nvcr.io/" + "n" * 250 + ":tag"),
    ("ami_ssm_parameter", "aws/service/x"),
    ("ami_ssm_parameter", "ami-12345678"),
    ("vpc_id", "vpc-xyz"),
    ("subnet_id", "subnet-1"),
    ("vpc_id", "vpc-0123456789abcdef0"),
    ("availability_zone", "east"),
    ("subnet_id", "subnet-0123456789abcdef0"),
    ("key_name", "bad/name"),
    ("data_bucket", "s3://my-imagenet"),
    ("data_bucket", "my-imagenet/train"),
    ("data_bucket", "My_Bucket"),
    ("data_bucket", "ab"),
    ("data_bucket", "my..bucket"),
    ("cluster_name", "My Cluster"),
    ("cluster_name", "1cluster"),
    ("cluster_name", "a" * 40),
    ("idle_minutes", "-1"),
    ("idle_minutes", "soon"),
    ("idle_minutes", "1411"),
    ("spot", "cheap"),
    ("spot_max_price", "0"),
    ("spot_max_price", "-1"),
    ("spot_max_price", "0.001"),
    ("spot_max_price", "lots"),
    ("spot_max_price", "nan"),
    ("spot_max_price", "inf"),
    ("spot_max_price", True),
    ("access", "vpn"),
    ("private_subnet", "true"),
    ("ami_ssm_parameter", AMI_PARAMETERS["proprietary"]),
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


def test_access_ssm_refuses_an_ssh_cidr_and_private_subnets_need_it():
    with pytest.raises(ConfigError, match="access=ssm opens no inbound port"):
        ClusterConfig.from_context({"access": "ssm", "ssh_cidr": "203.0.113.7/32"})
    config = ClusterConfig.from_context({"access": "SSM", "private_subnet": "true"})
    assert (config.access, config.private_subnet) == ("ssm", True)


def test_spot_is_off_by_default_and_its_price_is_coerced():
    assert ClusterConfig.from_context({}).spot is False
    config = ClusterConfig.from_context({"spot": "true", "spot_max_price": " $0.45 "})
    assert config.spot is True and config.spot_max_price == 0.45
    assert ClusterConfig.from_context({"spot": "yes", "spot_max_price": ""}).spot_max_price is None


def test_a_spot_price_for_on_demand_nodes_is_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_context({"spot_max_price": "0.45"})
    assert str(caught.value) == "invalid config spot_max_price=0.45: needs -c spot=true"


# ---------------------------------------------------------------- what synth refuses to guess (issue 19 §4, §5, §13)

PINNED = {"ssh_cidr": "203.0.113.7/32", "availability_zone": "us-east-1a", "ami_id": "ami-0123456789abcdef0"}


def _synth_config(context, region="us-east-1"):
    from stacks.pins import synth_config

    return synth_config(context, region)


def test_access_ssh_without_ssh_cidr_is_refused_at_synth_in_one_line():
    """A cluster nothing can reach: a 30-45 minute deploy, then every task times out while it bills."""
    context = {k: v for k, v in PINNED.items() if k != "ssh_cidr"}
    with pytest.raises(ConfigError) as caught:
        _synth_config(context)
    message = str(caught.value)
    assert caught.value.key == "ssh_cidr" and "\n" not in message
    assert "-c ssh_cidr=" in message and "access=ssm" in message
    assert _synth_config({**context, "access": "ssm"}).access == "ssm"


@pytest.mark.parametrize("region", ["us-east-1", None])
def test_an_unchecked_availability_zone_is_refused_in_one_line(region):
    """An AZ name is per account, and big GPU types are offered in few AZs: without an explicit AZ,
    an existing subnet or the offering `fab preflight` cached, synth does not guess."""
    context = {**PINNED, "instance_type": "p4d.24xlarge", "availability_zone": None}
    with pytest.raises(ConfigError) as caught:
        _synth_config(context, region)
    message = str(caught.value)
    assert caught.value.key == "availability_zone" and "\n" not in message
    assert "run `fab preflight --instance-type p4d.24xlarge` first, or pass -c availability_zone=" in message
    cached = {**context, offerings_context_key("us-east-1", "p4d.24xlarge"): ["us-east-1f", "us-east-1c"]}
    assert _synth_config(cached).availability_zone == "us-east-1c"
    existing = {**context, "vpc_id": "vpc-0123456789abcdef0", "subnet_id": "subnet-0123456789abcdef0"}
    existing["availability_zone"] = "us-east-1b"
    assert _synth_config(existing).availability_zone == "us-east-1b"


@pytest.mark.parametrize("region", ["us-east-1", None])
def test_an_unpinned_ami_is_refused_in_one_line(region):
    """`.../latest/ami-id` resolved at deploy replaces every node after a DLAMI release: synth takes
    the id `fab preflight` pinned in cdk.context.json, or -c ami_id."""
    from stacks.config import ami_context_key

    context = {**PINNED, "ami_id": None}
    with pytest.raises(ConfigError) as caught:
        _synth_config(context, region)
    message = str(caught.value)
    assert caught.value.key == "ami_id" and "\n" not in message
    assert "run `fab preflight --instance-type g4dn.2xlarge` first, or pass -c ami_id=" in message
    cached = {**context, ami_context_key("us-east-1", AMI_PARAMETERS["oss"]): "ami-0fedcba9876543210"}
    assert _synth_config(cached).ami_id == "ami-0fedcba9876543210"
    assert _synth_config({**cached, "ami_id": "ami-01234567"}).ami_id == "ami-01234567"  # -c wins
    with pytest.raises(ConfigError, match="ami_id"):  # a corrupt cache entry is not deployed
        _synth_config({**context, ami_context_key("us-east-1", AMI_PARAMETERS["oss"]): "latest"})


@pytest.mark.parametrize("value", ["ami-xyz", "ami-123", "i-0123456789abcdef0", "ami-0123456789ABCDEF0", "latest"])
def test_a_bad_ami_id_is_rejected_with_one_line(value):
    with pytest.raises(ConfigError) as caught:
        ClusterConfig.from_context({"ami_id": value})
    assert caught.value.key == "ami_id" and "\n" not in str(caught.value) and "expected" in str(caught.value)
