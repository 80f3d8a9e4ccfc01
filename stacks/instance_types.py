"""The one table of instance-type facts: every type `instance_type` accepts, with what the CDK app,
the preflight, the cost tasks and the tests need to know about it. No CDK imports: fab reads it too.

Sources (checked against the EC2 documentation, "Accelerated computing instance types" and "EFA
supported instance types"): vCPUs, GPUs and GPU memory per size; `efa` is the number of EFA-capable
network cards (0: no EFA); `ami` names the Deep Learning AMI whose driver supports the family;
`gpudirect_rdma`: EFA reads and writes GPU memory directly (only P4d, P4de and P5: aws/aws-ofi-nccl#547,
aws-ofi-nccl doc/efa-env-var.md). `efa=auto` turns EFA on only there: elsewhere the plugin stages every
transfer through host memory, a path AWS does not test on g-types (aws-ofi-nccl v1.7.3-aws release notes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Deep Learning Base AMIs (Ubuntu 22.04), by driver flavour; public SSM parameters resolved at deploy.
AMI_PARAMETERS = {
    # G4dn, G5, G6, Gr6, G6e, P4d, P4de, P5, P5e, P5en and newer (NVIDIA's open kernel modules).
    "oss": "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
    # The proprietary driver: the one that still drives V100s (P3, P3dn).
    "proprietary": "/aws/service/deeplearning/ami/x86_64/base-proprietary-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id",
}


@dataclass(frozen=True)
class InstanceType:
    name: str
    vcpus: int
    gpus: int
    gpu: str
    gpu_memory_gib: int
    efa: int = 0
    ami: str = "oss"
    gpudirect_rdma: bool = False

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def ami_parameter(self) -> str:
        return AMI_PARAMETERS[self.ami]


def _family(
    family: str,
    gpu: str,
    memory: int,
    sizes: dict[str, tuple[int, int, int]],
    ami: str = "oss",
    gpudirect_rdma: bool = False,
) -> dict[str, InstanceType]:
    """sizes: SIZE -> (vCPUs, GPUs, EFA cards)."""
    return {
        f"{family}.{size}": InstanceType(f"{family}.{size}", vcpus, gpus, gpu, memory, efa, ami, gpudirect_rdma)
        for size, (vcpus, gpus, efa) in sizes.items()
    }


_SINGLE_TO_OCTO = {
    "xlarge": (4, 1, 0),
    "2xlarge": (8, 1, 0),
    "4xlarge": (16, 1, 0),
    "8xlarge": (32, 1, 1),
    "16xlarge": (64, 1, 1),
    "12xlarge": (48, 4, 1),
    "24xlarge": (96, 4, 1),
    "48xlarge": (192, 8, 1),
}

INSTANCE_TYPES: dict[str, InstanceType] = {
    **_family(
        "g4dn",
        "T4",
        16,
        {
            "xlarge": (4, 1, 0),
            "2xlarge": (8, 1, 0),
            "4xlarge": (16, 1, 0),
            "8xlarge": (32, 1, 1),
            "16xlarge": (64, 1, 1),
            "12xlarge": (48, 4, 1),
            "metal": (96, 8, 1),
        },
    ),
    **_family("g5", "A10G", 24, _SINGLE_TO_OCTO),
    **_family("g6", "L4", 24, _SINGLE_TO_OCTO),
    **_family("g6e", "L40S", 48, {**_SINGLE_TO_OCTO, "24xlarge": (96, 4, 2), "48xlarge": (192, 8, 4)}),
    **_family(
        "p3", "V100", 16, {"2xlarge": (8, 1, 0), "8xlarge": (32, 4, 0), "16xlarge": (64, 8, 0)}, ami="proprietary"
    ),
    **_family("p3dn", "V100", 32, {"24xlarge": (96, 8, 1)}, ami="proprietary"),
    **_family("p4d", "A100", 40, {"24xlarge": (96, 8, 4)}, gpudirect_rdma=True),
    **_family("p4de", "A100", 80, {"24xlarge": (96, 8, 4)}, gpudirect_rdma=True),
    **_family("p5", "H100", 80, {"48xlarge": (192, 8, 32)}, gpudirect_rdma=True),
}

FAMILIES = sorted({t.family for t in INSTANCE_TYPES.values()})


def lookup(name: str) -> Optional[InstanceType]:
    return INSTANCE_TYPES.get(name)
