"""`fab data`'s use case: prepare a data set on /data with train.prepare, from the head node or on every node
(imagenet --stage-to: each node's own disk); its command line (prepare_argv)."""

from __future__ import annotations

import shlex
import threading
from typing import Callable, Optional, Sequence

from fabric import Connection

from cluster_node.protocol import clusterdir
from clusterops.inventory import Inventory, Node
from clusterops.nodes import remote
from clusterops.run import launch, lifecycle
from train.catalog import DATASETS


def prepare(
    inv: Inventory,
    dataset: str,
    extra_args: Sequence[str] = (),
    all_nodes: bool = False,
    progress: Callable[[str], None] = print,
    connections: Optional[remote.Connections] = None,
) -> None:
    """train.prepare on the head node, or on every node at once (imagenet --stage-to: each its own copy, while
    every node bills), its output on this terminal; one line naming the nodes where it failed."""
    if all_nodes and any(a == "--from" or a.startswith("--from=") for a in extra_args):  # one folder, N downloads
        raise launch.LaunchError(
            "--from fetches onto the shared /data once: run `fab data` with it alone first, "
            "then --stage-to with --all-nodes"
        )
    if all_nodes and not staged_to(extra_args):
        # Every node would write the same /data folder at once: one node's start-over deletes another's files, and
        # the set left behind reads as prepared (meta.json matches), short of images.
        raise launch.LaunchError(
            '--all-nodes copies a data set onto each node\'s own disk (imagenet --extra "--stage-to PATH"); '
            f"{dataset} goes onto the shared /data once: run `fab data --dataset {dataset}` without --all-nodes"
        )
    pool = connections or remote.Connections(inv)
    nodes = list(inv.nodes) if all_nodes else [inv.head]
    try:
        argv = prepare_argv(inv, dataset, lifecycle.code_dir_on(pool.get(inv.head), inv), extra_args)
        at_once = " at once" if len(nodes) > 1 else ""
        where = ", ".join(node.name for node in nodes)
        progress(f"data: preparing {dataset} on {where}{at_once} (prepare.py; a data set already there is reused) ...")
        rows = remote.on_all(inv, nodes, lambda conn, node: _run(conn, node, argv, progress, len(nodes) > 1), pool)
    finally:
        if connections is None:
            pool.close()
    failed = [f"{row['node']} ({row.get('error') or 'exit %d' % row['exited']})" for row in rows if _failed(row)]
    if failed:
        raise remote.RemoteError(f"prepare.py {dataset} failed on {', '.join(failed)}")


def staged_to(extra_args: Sequence[str]) -> Optional[str]:
    """The --stage-to folder of prepare.py's arguments (`fab data --extra`), None without one."""
    for i, arg in enumerate(extra_args):
        if arg.startswith("--stage-to="):
            return arg.split("=", 1)[1]
        if arg == "--stage-to" and i + 1 < len(extra_args):
            return extra_args[i + 1]
    return None


def _run(conn: Connection, node: Node, argv: Sequence[str], say: Callable[[str], None], prefixed: bool) -> dict:
    """prepare.py on one node, its output here as it comes (each line led by the node's name when several run)."""
    streams = {"out_stream": _Lines(node.name, say), "err_stream": _Lines(node.name, say)} if prefixed else {}
    try:
        result = conn.run(shlex.join(argv), in_stream=False, warn=True, **streams)
    finally:  # a dropped connection too: its last part line
        for stream in streams.values():
            stream.end()
    return {"exited": result.exited}


def _failed(row: dict) -> bool:
    return not row["reachable"] or row["exited"] != 0


class _Lines:
    """A writable stream that hands on whole lines, each led by `name: ` (several nodes' output interleaved,
    never a line cut in two: invoke flushes after every chunk it writes, mid-line too)."""

    _lock = threading.Lock()  # one line at a time from every node's thread

    def __init__(self, name: str, say: Callable[[str], None]):
        self.name, self.say, self.partial = name, say, ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self._say(line)
        return len(text)

    def flush(self) -> None:
        """Nothing: a part line waits for the rest of it (end() hands on what is left)."""

    def end(self) -> None:
        if self.partial:
            self._say(self.partial)
            self.partial = ""

    def _say(self, line: str) -> None:
        with self._lock:
            self.say(f"{self.name}: {line}")


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
