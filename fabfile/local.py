"""The emulated cluster on this machine: `fab local.up`, `fab local.down`."""

from __future__ import annotations

import time

from invoke import Collection

from clusterops.local import cluster as localcluster
from clusterops.local import repair as localrepair

from .common import fail, given, inventory_path, progress, task, whole_number

_SPEC = localcluster.LocalSpec()  # the emulated cluster's defaults


@task(
    name="up",
    help={
        "nodes": f"node count (default {_SPEC.nodes})",
        "link": "cap each link, e.g. 1gbit",
        "slots": f"ranks per node (default {_SPEC.slots})",
        "name": f"cluster name (default {_SPEC.name})",
        "subnet": f"node addresses (default {_SPEC.subnet})",
        "replace": "replace a running cluster of that name, deleting its /data",
        "repair": "restart the dead nodes of the running cluster NAME, keeping /data (its recorded options stay)",
    },
)
def local_up(c, nodes=None, link=None, slots=None, name=None, subnet=None, replace=False, repair=False):
    """Start an emulated cluster on this machine (root): namespaces, sshd, /data."""
    if repair:
        return _repair(c, name or _SPEC.name, replace)
    numbers = dict(nodes=whole_number(nodes, "--nodes"), slots=whole_number(slots, "--slots"))
    spec = localcluster.LocalSpec(**given(name=name, link=link, subnet=subnet, **numbers))
    started = time.perf_counter()
    inv = localcluster.up(spec, inventory_path(c), replace=replace)
    print(
        f"local cluster {spec.name}: {len(inv.nodes)} node(s) "
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
        "name": f"cluster name (default {_SPEC.name})",
        "yes": "delete /data even if it holds runs not fetched since they changed",
    },
)
def local_down(c, name=None, yes=False):
    """Stop the emulated cluster, leaving no namespace, mount or process behind."""
    name = name or _SPEC.name
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
