"""The one table of training images: what each NGC PyTorch tag ships, read by the Dockerfile's default
(a test holds them equal), `-c image`'s default (stacks/config.py), the second test environment
(requirements-image.txt, scripts/test_image_torch.sh) and `fab check`'s version comparison.
No CDK imports: fab and the scripts read it too.

Sources, per row: NVIDIA's "PyTorch Release NN.MM" notes (docs.nvidia.com/deeplearning/frameworks/
pytorch-release-notes/rel-NN-MM.html: "Contents of the PyTorch container", "Driver Requirements",
"GPU Requirements"). The 24.12 page was not in the stored corpus when this was written; its torch and
Python are corroborated by `torch.__version__` / `python --version` printed inside the 24.12 container
by third parties (2.6.0a0+df5bbc09d1.nv24.12, Python 3.12.3); CUDA 12.6.3 and NCCL 2.23.4 are the
release notes' figures as the issue quotes them; "compute capability 6.0 and later" is what every
NGC 2x.xx page states under GPU Requirements until CUDA 13 (checked on 19.03, 20.02 and 22.02).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

REPOSITORY = "nvcr.io/nvidia/pytorch"


@dataclass(frozen=True)
class Image:
    tag: str  # e.g. 24.12-py3
    python: str  # major.minor of the image's interpreter
    torch: str  # torch.__version__ inside the image (an NGC pre-release build)
    torch_pypi: str  # the PyPI release with that torch's API: the second test environment installs it
    numpy: str  # the image's numpy (the trainer's tests are run against it)
    cuda: str  # CUDA toolkit of the release; torch.version.cuda reports major.minor
    nccl: str
    min_compute_capability: float  # the oldest GPU architecture the release supports
    pip_constraints: bool  # /etc/pip/constraint.txt pins every preinstalled package (25.03 and later)

    @property
    def image(self) -> str:
        return f"{REPOSITORY}:{self.tag}"

    def supports(self, compute_capability: float) -> bool:
        return compute_capability >= self.min_compute_capability


IMAGES = {
    image.image: image
    for image in (
        Image(
            tag="24.12-py3",
            python="3.12",
            torch="2.6.0a0+df5bbc09d1",
            torch_pypi="2.6.0",
            numpy="1.26.4",
            cuda="12.6.3",
            nccl="2.23.4",
            min_compute_capability=6.0,
            pip_constraints=False,
        ),
    )
}
# The pinned base. It stays at 24.12: it still drives V100s (p3, p3dn); see LATER_TAGS.
DEFAULT_IMAGE = f"{REPOSITORY}:24.12-py3"

# What is known of later tags, without a full row (no sourced torch/CUDA/NCCL here): why not to move yet.
# 25.03: NVIDIA's release notes (rel-25-12, "Starting from the 25.03 release ... /etc/pip/constraint.txt"):
# the Dockerfile's `pip install` would have to honour or edit that file. 25.08 and later: no Volta (as
# the issue states: CUDA 13 drops offline compilation for Maxwell, Pascal and Volta, CUDA toolkit release
# notes as quoted in pytorch/pytorch#157517); not checked against NVIDIA's 25.08 page here.
LATER_TAGS = {
    "25.03-py3": "adds /etc/pip/constraint.txt (pins every preinstalled package): the Dockerfile's pip must honour it",
    "25.08-py3": "drops Volta (compute capability 7.0): no V100 (p3, p3dn)",
}

# Compute capability of every GPU an accepted instance type carries (NVIDIA, "CUDA GPUs - Compute
# Capability", developer.nvidia.com/cuda-gpus).
GPU_COMPUTE_CAPABILITY = {"V100": 7.0, "T4": 7.5, "A100": 8.0, "A10G": 8.6, "L4": 8.9, "L40S": 8.9, "H100": 9.0}


def lookup(image: str) -> Optional[Image]:
    """The table's row for a full image reference (REPO:TAG), None when the table has none."""
    return IMAGES.get(image)


def default() -> Image:
    return IMAGES[DEFAULT_IMAGE]


def _same_release(found: Optional[str], expected: str) -> bool:
    """A node's version against the row's: equal up to the row's precision (CUDA 12.6.3 vs torch's
    "12.6"; NCCL "2.23.4"), ignoring the build suffix NGC adds to torch (".nv24.12")."""
    if not found or "." not in found:
        return False
    found = found.split(".nv")[0] if "+" in found else found
    return found == expected or expected.startswith(found + ".") or found.startswith(expected + ".")


def compare(image: str, node: dict) -> str:
    """One line: the node's torch, CUDA and NCCL against what `image` ships, naming every one that
    differs (NCCL only where a GPU reported one)."""
    row = lookup(image)
    if row is None:
        return f"image {image}: no row in stacks/images.py, versions not compared"
    wanted = {"torch": row.torch, "CUDA": row.cuda, "NCCL": row.nccl}
    found = {"torch": node.get("torch"), "CUDA": node.get("cuda"), "NCCL": node.get("nccl")}
    if found["NCCL"] is None:  # no GPU: torch reports no NCCL, nothing to compare
        wanted.pop("NCCL")
    differ = [
        f"{key} {found[key] or 'none'} (image ships {value})"
        for key, value in wanted.items()
        if not _same_release(found[key], value)
    ]
    if differ:
        return f"versions differ from {row.tag}'s: " + ", ".join(differ)
    return f"versions as {row.tag} ships: " + ", ".join(f"{key} {value}" for key, value in wanted.items())


def compare_nodes(image: str, rows: list[dict]) -> str:
    """`compare` for a cluster, in one line: nodes that report the same versions are compared once;
    groups that differ from each other are each named."""
    groups: dict[tuple, list[str]] = {}
    for row in rows:
        groups.setdefault((row.get("torch"), row.get("cuda"), row.get("nccl")), []).append(row["node"])
    lines = [compare(image, dict(zip(("torch", "cuda", "nccl"), key))) for key in groups]
    if len(groups) == 1:
        return f"{image}: {lines[0]}"
    return f"{image}: " + "; ".join(f"{','.join(nodes)}: {line}" for nodes, line in zip(groups.values(), lines))


def image_tag(context_hash: str, base_image: str) -> str:
    """The training image's tag: a new context or a new base image (`-c image`) is a new image, which a
    bootstrap run again on a running node builds (node-bootstrap.sh keeps an image whose tag it has)."""
    return hashlib.sha256(f"{context_hash} {base_image}".encode()).hexdigest()[:16]
