"""The one line the laptop sends to run a cluster_node program on a node:
`PYTHONPATH=<root> <python> -m cluster_node.<module> <args>`. The package root is the directory holding
the training program's directory: /workspace in the image, /data/code after `fab sync`, REPO/assets on the
emulated cluster. The command sets PYTHONPATH itself: an SSH session on the emulated cluster does not
carry the laptop's environment."""

from __future__ import annotations

import posixpath
import shlex
from typing import Optional

from clusterops.inventory import Inventory

SYNCED = "code"  # DATA/code: `fab sync`'s package root (train/ and cluster_node/)


def synced_root(inventory: Inventory) -> str:
    return posixpath.join(inventory.data_dir, SYNCED)


def package_root(code_dir: str) -> str:
    """The package root of a training-program directory (ROOT/train)."""
    return posixpath.dirname(code_dir.rstrip("/"))


def python_path(inventory: Inventory, code_dir: Optional[str] = None) -> str:
    """PYTHONPATH for the node programs: the root beside `code_dir` (fab sync's /data/code when it made
    one), then the image's. A /data/code synced by an older fab, with train/ but no cluster_node/, then
    still finds the image's cluster_node instead of failing every launch."""
    roots = [package_root(code_dir or inventory.code_dir), package_root(inventory.code_dir)]
    return ":".join(dict.fromkeys(roots))


def node_command(
    inventory: Inventory,
    module: str,
    *args: object,
    code_dir: Optional[str] = None,
    timeout: Optional[float] = None,
) -> str:
    """The shell line running `python -m cluster_node.MODULE ARGS` with the package beside `code_dir`
    (default the inventory's: the image's, or the checkout's on the emulated cluster), under
    timeout(1) when given."""
    root = python_path(inventory, code_dir)
    argv = [inventory.python, "-m", f"cluster_node.{module}", *map(str, args)]
    if timeout is not None:
        argv = ["timeout", f"{timeout:g}", *argv]
    return f"PYTHONPATH={shlex.quote(root)} {shlex.join(argv)}"
