"""Node health for `fab check` and `fab train`: run the probe on every node, judge the facts with
cluster_node.health, and keep the transport verdict `fab train` reads."""

from __future__ import annotations

import time
from typing import Optional, Sequence

from cluster_node.health import (  # noqa: F401  (the verdict names, for the tasks)
    MAX_CLOCK_SKEW_S,
    SLOW_LINK_SHARE,
    NodeHealth,
    as_json,
    assess,
    clock_skew,
    fit_to_train,
    parse_probe,
)

# Runs on the node (bash + the node's python): one JSON line of facts. See probe_script().
# nvidia-smi --query-gpu fields (NVIDIA's nvidia-smi manual, `--help-query-gpu`): name, driver_version and
# ecc.errors.uncorrected.volatile.total ("[N/A]" where the GPU has no ECC). Xids are the driver's
# "NVRM: Xid (PCI:0000:01:00): 79, ..." kernel-log lines (dmesg, else the kernel journal). DCGM's quick
# diagnostic (`dcgmi diag -r 1`, exit status non-zero on a failed test) runs only where dcgmi exists.
PROBE = r"""
data=__DATA__
smi=absent; gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
  if gpus=$(nvidia-smi --query-gpu=name,driver_version,ecc.errors.uncorrected.volatile.total \
            --format=csv,noheader 2>&1); then smi=ok; else smi="failed: $(echo "$gpus" | head -n 1)"; gpus=""; fi
  gpus=$(echo "$gpus" | paste -sd';')
fi
xid_source="not available"; klog=""
if klog=$(dmesg 2>/dev/null); then xid_source=dmesg
elif klog=$(journalctl -k -q --no-pager 2>/dev/null); then xid_source="kernel journal"; fi
xids=$(echo "$klog" | grep -oE 'NVRM: Xid \([^)]*\): [0-9]+' | grep -oE '[0-9]+$' | sort -u | paste -sd, || true)
dcgm="not available"
if command -v dcgmi >/dev/null 2>&1; then
  if out=$(timeout 120 dcgmi diag -r 1 2>&1); then dcgm=pass
  elif echo "$out" | grep -qi connect; then dcgm="not available (no DCGM host engine)"
  else dcgm="fail: $(echo "$out" | grep -i fail | head -n 1)"; fi
fi
mounted=no; mountpoint -q "$data" && mounted=yes
writable=no; probe="$data/.cluster/health.$(hostname).$$"
mkdir -p "$data/.cluster" 2>/dev/null && echo ok > "$probe" 2>/dev/null && rm -f "$probe" && writable=yes
free_kb=$(df -Pk "$data" 2>/dev/null | awk 'NR == 2 {print $4}')
__PYTHON__ - "$gpus" "$xids" "$mounted" "$writable" "${free_kb:-0}" "$smi" "$xid_source" "$dcgm" <<'PY'
import json, socket, sys, time
gpus, xids, mounted, writable, free_kb, smi, xid_source, dcgm = sys.argv[1:]
facts = {"time": time.time(), "hostname": socket.gethostname().split(".")[0], "mounted": mounted == "yes",
         "writable": writable == "yes", "free_gb": int(free_kb) / 1e6, "gpus": [], "nvidia_smi": smi,
         "xids": [int(x) for x in xids.split(",") if x], "xid_source": xid_source, "dcgm": dcgm}
for row in filter(None, gpus.split(";")):
    name, driver, ecc = (part.strip() for part in row.split(",")[:3])
    facts["gpus"].append({"name": name, "driver": driver, "ecc_uncorrected": int(ecc) if ecc.isdigit() else None})
try:
    if facts["gpus"]:  # NCCL's version needs torch and CUDA loaded
        import torch
        facts["torch"] = torch.__version__
        facts["cuda"] = torch.version.cuda
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    else:  # no GPU: torch's build facts without loading it (1-2 s on a busy node, before every launch)
        import importlib.util, pathlib
        build = {}
        exec((pathlib.Path(importlib.util.find_spec("torch").origin).parent / "version.py").read_text(), build)
        facts["torch"], facts["cuda"], facts["nccl"] = build["__version__"], build["cuda"], None
except Exception as error:  # a broken torch is a finding, not a crash
    facts["torch"] = f"unusable: {error}"
print(json.dumps(facts))
PY
"""


def probe_script(python: str, data_dir: str) -> str:
    import shlex

    return PROBE.replace("__DATA__", shlex.quote(data_dir)).replace("__PYTHON__", shlex.quote(python))


def transport_file(inventory) -> str:
    """Where `fab check` keeps its transport verdict for `fab train` (the head node's /data)."""
    return f"{inventory.data_dir}/.cluster/transport.json"


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


def probe_nodes(inventory, nodes) -> tuple[dict[str, Optional[dict]], dict[str, str]]:
    """Every node's probe facts in parallel (None: unreachable, its error in facts' place is lost
    only to the verdict "unreachable") and the interface holding its private address."""
    from . import remote

    def one(connection, node) -> dict:
        before = time.time()
        facts = parse_probe(remote.sh(connection, probe_script(inventory.python, inventory.data_dir), timeout=180))
        facts["skew_s"] = clock_skew(facts["time"], before, time.time())
        return {"facts": facts, "interface": remote.detect_interface(connection, node)}

    rows = remote.on_all(inventory, nodes, one)
    facts = {row["node"]: row.get("facts") if row["reachable"] else None for row in rows}
    interfaces = {row["node"]: row["interface"] for row in rows if row["reachable"]}
    return facts, interfaces


def quick(inventory, nodes) -> list[NodeHealth]:
    """The part `fab train` runs first: reachable, /data writable, versions agree, GPU count and model."""
    facts, _ = probe_nodes(inventory, nodes)
    count, model = expected_gpus(inventory.instance_type, inventory.gpus_per_node)
    return assess(facts, count, model)
