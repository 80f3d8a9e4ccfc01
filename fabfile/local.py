"""The emulated cluster on this machine: `fab local.up`, `fab local.down`."""

from __future__ import annotations

import time

from invoke import Collection

from clusterops.local import cluster as localcluster
from clusterops.local import repair as localrepair

from .common import fail, inventory_path, progress, task, whole_number


@task(
    name="up",
    help={
        "nodes": "node count (default 2)",
        "link": "cap each link, e.g. 1gbit",
        "slots": "ranks per node (default 1)",
        "name": "cluster name (default local)",
        "subnet": "node addresses (default 10.213.0.0/24)",
        "replace": "replace a running cluster of that name, deleting its /data",
        "repair": "restart the dead nodes of the running cluster NAME, keeping /data (its recorded options stay)",
    },
)
def local_up(c, nodes="2", link=None, slots="1", name="local", subnet="10.213.0.0/24", replace=False, repair=False):
    """Start an emulated cluster on this machine (root): namespaces, sshd, /data."""
    if repair:
        return _repair(c, name, replace)
    spec = localcluster.LocalSpec(
        name=name, nodes=whole_number(nodes, "--nodes"), slots=whole_number(slots, "--slots"), link=link, subnet=subnet
    )
    started = time.perf_counter()
    inv = localcluster.up(spec, inventory_path(c), replace=replace)
    print(
        f"local cluster {name}: {len(inv.nodes)} node(s) "
        f"{', '.join(n.private_ip for n in inv.nodes)} up in {time.perf_counter() - started:.2f} s"
        + (f", links capped at {link}" if link else "")
    )


def _repair(c, name: str, replace: bool) -> None:
    if replace:
        raise fail(localcluster.LocalClusterError("--repair keeps /data, --replace deletes it: give one"))
    started = time.perf_counter()
    restarted = localrepair.repair(name, inventory_path(c))
    if restarted:
        seconds = time.perf_counter() - started
        print(f"local cluster {name}: {', '.join(restarted)} restarted in {seconds:.2f} s, /data kept")
    else:
        print(f"local cluster {name}: every node answers; nothing to repair")


@task(
    name="down",
    help={
        "name": "cluster name (default local)",
        "yes": "delete /data even if it holds runs not fetched since they changed",
    },
)
def local_down(c, name="local", yes=False):
    """Stop the emulated cluster, leaving no namespace, mount or process behind."""
    unfetched = localcluster.unfetched_runs(localcluster.STATE_ROOT / name / "shared")
    if unfetched and not yes and (localcluster.STATE_ROOT / name / "cluster.json").exists():
        # like `local.up` without --replace: nothing is deleted until the user says so
        raise fail(
            localcluster.LocalClusterError(
                f"local cluster {name}'s /data holds runs never fetched or changed since: {', '.join(unfetched)}; "
                f"`fab fetch --run NAME` each, or `fab local.down --yes` deletes them"
            )
        )
    if (localcluster.STATE_ROOT / name).exists():  # several seconds: every node's processes, then /data
        progress(f"local.down: stopping {name}'s nodes and deleting its /data ...")
    try:
        removed = localcluster.down(name, inventory_path(c))
    except localcluster.NothingToDo as nothing:
        print(nothing)
        return
    if unfetched:
        print(f"deleted with /data, never fetched or changed since: runs {', '.join(unfetched)}")
    namespaces = [r for r in removed if r.startswith("gc-")]  # down() also lists the bridge (gcbr-...)
    bridge = " and the bridge" if len(namespaces) < len(removed) else ""
    print(f"local cluster {name} down ({len(namespaces)} node namespace(s){bridge} removed)")


local = Collection("local", local_up, local_down)
