"""Node health for `fab check` and `fab train`: the probe's command line, the verdict names of
cluster_node.programs.health, and the transport verdict `fab train` reads. nodeprobe.py runs the probe over SSH."""

from __future__ import annotations

from typing import Optional, Sequence

from cluster_node.programs.health import (  # noqa: F401  (the verdict names, for the tasks)
    MAX_CLOCK_SKEW_S,
    SLOW_LINK_SHARE,
    NodeHealth,
    as_json,
    assess,
    clock_skew,
    fit_to_train,
    parse_probe,
)
from cluster_node.protocol import clusterdir
from clusterops.nodes.command import node_command


def probe_command(inventory, code_dir: Optional[str] = None, copy: Optional[str] = None) -> str:
    """The one line that prints a node's facts (cluster_node.programs.probe); `copy`: a run's data set on each
    node's own disk (`fab train --data`), which the node must hold, staged whole."""
    more = ("--copy", copy) if copy else ()
    return node_command(inventory, "programs.probe", "--data", inventory.data_dir, *more, code_dir=code_dir)


def transport_file(inventory) -> str:
    """Where `fab check` keeps its transport verdict for `fab train` (the head node's /data)."""
    return f"{inventory.data_dir}/{clusterdir.CLUSTER}/{clusterdir.TRANSPORT_JSON}"


def transport_verdict(transport: dict[str, str], expect_efa: bool, checked_at: str) -> dict:
    """What `fab check` found NCCL on, per node, and the nodes not on EFA where EFA was expected."""
    not_efa = [n for n, t in transport.items() if expect_efa and "efa" not in t.lower()]
    return {"expect_efa": expect_efa, "transport": dict(transport), "not_efa": not_efa, "checked_at": checked_at}


def transport_refusal(verdict: Optional[dict], nodes: Sequence[str], expect_efa: bool) -> Optional[str]:
    """One line refusing a run on nodes that `fab check` found off EFA on an EFA cluster, else None
    (no verdict yet, or a fine one). aws-ofi-nccl that does not load leaves NCCL on sockets silently."""
    bad = [n for n in (verdict or {}).get("not_efa", []) if n in nodes] if expect_efa else []
    if not bad:
        return None
    found = sorted({verdict["transport"].get(n, "?") for n in bad} if verdict else set())
    return (
        f"error: `fab check` ({verdict.get('checked_at') if verdict else '?'}) found NCCL on {', '.join(found)}, "
        f"not EFA, on {', '.join(bad)}: fix the plugin and run `fab check` again, or train over TCP with "
        "`fab train --allow-tcp`"
    )


def expected_gpus(instance_type: str, gpus_per_node: int) -> tuple[int, Optional[str]]:
    """GPU count and model a node should show, from the instance-type table (model None: unknown)."""
    from stacks.instance_types import lookup

    known = lookup(instance_type)
    return (known.gpus, known.gpu) if known else (gpus_per_node, None)
