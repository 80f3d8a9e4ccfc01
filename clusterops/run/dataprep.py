"""`fab data`'s use case: prepare a data set on /data with train.prepare, from the head node or on every node
(imagenet --stage-to: each node's own disk); its command line (prepare_argv)."""

from __future__ import annotations

import shlex
from typing import Callable, Sequence

from cluster_node.protocol import clusterdir
from clusterops.inventory import Inventory
from clusterops.nodes import remote
from clusterops.run import launch, lifecycle
from train.catalog import DATASETS


def prepare(
    inv: Inventory,
    dataset: str,
    extra_args: Sequence[str] = (),
    all_nodes: bool = False,
    progress: Callable[[str], None] = print,
) -> None:
    """train.prepare on the head node (or every node), its output on this terminal; one line when it fails."""
    with remote.connect(inv, inv.head) as conn:
        code_dir = lifecycle.code_dir_on(conn, inv)
    argv = prepare_argv(inv, dataset, code_dir, extra_args)
    for node in inv.nodes if all_nodes else [inv.head]:
        progress(f"data: preparing {dataset} on {node.name} (prepare.py; a data set already there is reused) ...")
        with remote.connect(inv, node) as conn:
            result = conn.run(shlex.join(argv), in_stream=False, warn=True)
        if result.exited != 0:
            raise remote.RemoteError(f"prepare.py {dataset} failed on {node.name} (exit {result.exited})")


def prepare_argv(inventory: Inventory, dataset: str, code_dir: str, extra_args: Sequence[str]) -> list[str]:
    """The train.prepare command for `fab data`."""
    if dataset not in DATASETS:
        raise launch.LaunchError(f"invalid --dataset {dataset!r}: one of {', '.join(DATASETS)}")
    # The marker keeps the autostop watchdog from stopping the cluster during a long preparation.
    argv = [
        *launch.node_program(inventory, code_dir, "prepare"),
        "--busy-dir",
        f"{inventory.data_dir}/{clusterdir.CLUSTER}/{clusterdir.BUSY_DIR}",
        dataset,
    ]
    if dataset == "imagenet":
        if "--source" not in extra_args:
            argv += ["--source", launch.data_path(inventory, dataset)]
    else:
        argv += ["--out", launch.data_path(inventory, dataset)]
    return argv + list(extra_args)
