"""Run cluster_node.programs.probe on nodes over SSH (in parallel) and judge the facts: `fab check` and the quick
check `fab train` runs first. Apart from health.py so that remote.py, which uploads the probe's command,
and this, which runs it over remote's SSH, do not import each other."""

from __future__ import annotations

import time
from typing import Optional

from clusterops.nodes import remote
from clusterops.nodes import view as nodeview
from clusterops.nodes.health import NodeHealth, assess, clock_skew, expected_gpus, parse_probe, probe_command


def probe_nodes(inventory, nodes) -> tuple[dict[str, Optional[dict]], dict[str, str]]:
    """Every node's probe facts in parallel (None: unreachable, its error in facts' place is lost
    only to the verdict "unreachable") and the interface holding its private address."""
    command = probe_command(inventory)

    def one(connection, node) -> dict:
        before = time.time()
        facts = parse_probe(remote.sh(connection, command, timeout=180))
        facts["skew_s"] = clock_skew(facts["time"], before, time.time())
        return {"facts": facts, "interface": nodeview.detect_interface(connection, node)}

    rows = remote.on_all(inventory, nodes, one)
    facts = {row["node"]: row.get("facts") if row["reachable"] else None for row in rows}
    interfaces = {row["node"]: row["interface"] for row in rows if row["reachable"]}
    return facts, interfaces


def quick(inventory, nodes) -> list[NodeHealth]:
    """The part `fab train` runs first: reachable, /data writable, versions agree, GPU count and model."""
    facts, _ = probe_nodes(inventory, nodes)
    count, model = expected_gpus(inventory.instance_type, inventory.gpus_per_node)
    return assess(facts, count, model)
