"""The emulated cluster on this machine: `fab local.up`, `fab local.down`."""

from __future__ import annotations

import time

from fabric import task
from invoke import Collection

from clusterops import localcluster

from .common import ERRORS, fail, inventory_path, whole_number


@task(
    name="up",
    help={
        "nodes": "node count (default 2)",
        "link": "cap each link, e.g. 1gbit",
        "slots": "ranks per node (default 1)",
        "name": "cluster name (default local)",
        "subnet": "node addresses (default 10.213.0.0/24)",
        "replace": "replace a running cluster of that name, deleting its /data",
    },
)
def local_up(c, nodes="2", link=None, slots="1", name="local", subnet="10.213.0.0/24", replace=False):
    """Start an emulated cluster on this machine (root): namespaces, sshd on 4444, shared /data."""
    spec = localcluster.LocalSpec(
        name=name, nodes=whole_number(nodes, "--nodes"), slots=whole_number(slots, "--slots"), link=link, subnet=subnet
    )
    started = time.perf_counter()
    try:
        inv = localcluster.up(spec, inventory_path(c), replace=replace)
    except ERRORS as error:
        raise fail(error) from None
    print(
        f"local cluster {name}: {len(inv.nodes)} node(s) "
        f"{', '.join(n.private_ip for n in inv.nodes)} up in {time.perf_counter() - started:.2f} s"
        + (f", links capped at {link}" if link else "")
    )


@task(name="down", help={"name": "cluster name (default local)"})
def local_down(c, name="local"):
    """Stop the emulated cluster: no namespace, bridge, process or mount is left behind."""
    unfetched = localcluster.unfetched_runs(localcluster.STATE_ROOT / name / "shared")
    try:
        removed = localcluster.down(name, inventory_path(c))
    except localcluster.NothingToDo as nothing:
        print(nothing)
        return
    except ERRORS as error:
        raise fail(error) from None
    if unfetched:
        print(
            f"deleted with /data, never fetched: runs {', '.join(unfetched)} "
            "(next time: `fab fetch --run NAME` before `fab local.down`)"
        )
    print(f"local cluster {name} down ({len(removed)} namespace(s)/bridge removed)")


local = Collection("local", local_up, local_down)
