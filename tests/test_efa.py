"""Which types `efa=auto` turns EFA on for (stacks/instance_types.py's `gpudirect_rdma`, read by
stacks/config.py), and what `efa=on` still allows."""

import pytest

from stacks.config import ClusterConfig
from stacks.instance_types import INSTANCE_TYPES

SSM_PRIVATE = {"access": "ssm", "private_subnet": "true"}
SSH = {"ssh_cidr": "203.0.113.7/32"}


@pytest.mark.parametrize(
    "instance_type, context, cards",
    [
        ("p4d.24xlarge", SSM_PRIVATE, 4),
        ("p4de.24xlarge", SSM_PRIVATE, 4),
        ("p5.48xlarge", SSM_PRIVATE, 32),
        ("g4dn.12xlarge", {}, 0),
        ("g5.12xlarge", {}, 0),
        ("g6.48xlarge", {}, 0),
        ("g6e.48xlarge", SSM_PRIVATE, 0),
        ("p3dn.24xlarge", {}, 0),
    ],
)
def test_efa_auto_is_on_only_where_the_gpus_and_efa_do_gpudirect_rdma(instance_type, context, cards):
    """Only P4d, P4de and P5 pair EFA with GPUDirect RDMA (aws/aws-ofi-nccl#547, bwbarrett, Aug 2025:
    "the only instance types in EC2 that support GPUDirect RDMA are the P-series starting with p4d";
    aws-ofi-nccl doc/efa-env-var.md: "only p4 and p5 instances support both EFA and ... GPUDirect RDMA").
    Elsewhere aws-ofi-nccl falls back to its send/recv protocol through host bounce buffers
    (doc/plugin-initialization.md), a path AWS does not test on g-types (the plugin's v1.7.3-aws notes:
    "tested on P3dn, P4d/P4de, and P5"): auto leaves it off, `efa=on` still turns it on."""
    config = ClusterConfig.from_context({"instance_type": instance_type, **(context or SSH)})
    assert config.efa_cards == cards
    if not cards:
        assert "GPUDirect RDMA" in (config.efa_note or "") and "efa=on" in config.efa_note


@pytest.mark.parametrize("instance_type", ["g4dn.12xlarge", "g5.12xlarge", "p3dn.24xlarge"])
def test_efa_on_still_turns_it_on_where_there_is_no_gpudirect_rdma(instance_type):
    config = ClusterConfig.from_context({"instance_type": instance_type, "efa": "on", **SSH})
    assert config.efa_cards == INSTANCE_TYPES[instance_type].efa == 1 and config.efa_note is None


def test_the_table_marks_gpudirect_rdma_only_on_p4d_p4de_and_p5():
    marked = {t.family for t in INSTANCE_TYPES.values() if t.gpudirect_rdma}
    assert marked == {"p4d", "p4de", "p5"}
    assert all(t.efa for t in INSTANCE_TYPES.values() if t.gpudirect_rdma)
