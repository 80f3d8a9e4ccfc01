"""Node health for `fab check`: one probe per node, then a verdict per node (ok, degraded, bad) with
its reasons. `bad` means the node must not train; `degraded` trains, with a warning."""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

# Xid codes that mean the GPU or its memory cannot be trusted (NVIDIA's Xid catalogue): 48 double-bit
# ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92-95 ECC (corrected storm, contained,
# uncontained), 119/120 GSP.
FATAL_XIDS = {48, 63, 64, 74, 79, 92, 94, 95, 119, 120}
MIN_FREE_GB = {"bad": 1.0, "degraded": 10.0}
MAX_CLOCK_SKEW_S = 1.0
SLOW_LINK_SHARE = 0.7  # a pair below 70% of the median link is slow

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


@dataclass
class NodeHealth:
    node: str
    verdict: str = "ok"
    reasons: list[str] = field(default_factory=list)  # why the verdict is not ok
    notes: list[str] = field(default_factory=list)  # checks that could not run here (no effect on the verdict)
    details: dict = field(default_factory=dict)  # what was found: GPUs, versions, transport, /data

    def mark(self, verdict: str, reason: str) -> None:
        order = ("ok", "degraded", "bad")
        if order.index(verdict) > order.index(self.verdict):
            self.verdict = verdict
        self.reasons.append(reason)


def parse_probe(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def _majority(values: Sequence) -> object:
    return Counter(values).most_common(1)[0][0] if values else None


def assess(
    facts: dict[str, Optional[dict]],
    expected_gpus: int,
    expected_gpu: Optional[str],
    controller_time: Optional[float] = None,
    links: Optional[dict[tuple[str, str], float]] = None,
    transport: Optional[dict[str, str]] = None,
    expect_efa: bool = False,
) -> list[NodeHealth]:
    """A verdict per node from its probe facts (None: unreachable), the pairwise link rates (Gbit/s)
    and the NCCL transport each node reported."""
    reachable = {name: f for name, f in facts.items() if f is not None}
    versions = {key: _majority([f.get(key) for f in reachable.values()]) for key in ("torch", "cuda", "nccl")}
    drivers = _majority([g["driver"] for f in reachable.values() for g in f["gpus"][:1]])
    median_link = statistics.median(links.values()) if links else None
    out = []
    for name, f in facts.items():
        health = NodeHealth(name)
        if f is None:
            health.mark("bad", "unreachable")
            out.append(health)
            continue
        _assess_gpus(health, f, expected_gpus, expected_gpu, drivers)
        _assess_storage(health, f)
        for key, majority in versions.items():
            if f.get(key) != majority:
                health.mark("degraded", f"{key} {f.get(key)} differs from the other nodes' {majority}")
        skew = f.get("skew_s", None if controller_time is None else f["time"] - controller_time)
        if skew is not None and abs(skew) > MAX_CLOCK_SKEW_S:
            health.mark("degraded", f"clock off by {skew:+.1f} s")
        for (a, b), rate in (links or {}).items():
            if name in (a, b) and median_link and rate < SLOW_LINK_SHARE * median_link:
                health.mark("degraded", f"slow link {a}->{b}: {rate:.2f} Gbit/s, median {median_link:.2f}")
        chosen = (transport or {}).get(name)
        if expect_efa and chosen and "efa" not in chosen.lower():
            health.mark("bad", f"NCCL uses {chosen}, not EFA: the image's aws-ofi-nccl plugin did not load")
        health.details = _details(f, chosen)
        out.append(health)
    return out


def _details(f: dict, transport: Optional[str]) -> dict:
    gpus = f.get("gpus") or []
    return {
        "hostname": f.get("hostname"),
        "gpus": len(gpus),
        "gpu": gpus[0]["name"] if gpus else None,
        "driver": gpus[0]["driver"] if gpus else None,
        **{key: f.get(key) for key in ("torch", "cuda", "nccl", "free_gb", "xid_source", "dcgm")},
        "transport": transport,
    }


def _assess_gpus(health: NodeHealth, f: dict, expected: int, model: Optional[str], driver: object) -> None:
    gpus = f["gpus"]
    smi = f.get("nvidia_smi", "absent")
    if not gpus:
        if smi.startswith("failed"):
            health.mark("bad", f"nvidia-smi {smi}")
        elif model:
            health.mark("bad", f"no GPU visible (nvidia-smi {smi}), expected {expected} {model}")
        else:
            health.notes.append("GPU checks not available (no nvidia-smi: CPU node)")
        return
    if f.get("xid_source") == "not available":
        health.notes.append("Xid check not available (no dmesg or kernel journal access)")
    if str(f.get("dcgm", "")).startswith("fail"):
        health.mark("bad", f"DCGM diagnostic {f['dcgm']}")
    if len(gpus) < expected:
        health.mark("bad", f"{len(gpus)} GPU(s), expected {expected}")
    if model and not all(model.lower() in g["name"].lower() for g in gpus):
        health.mark("bad", f"GPU model {gpus[0]['name']}, expected {model}")
    ecc = sum(g["ecc_uncorrected"] or 0 for g in gpus)
    if ecc:
        health.mark("bad", f"{ecc} uncorrectable ECC error(s)")
    fatal = sorted(set(f.get("xids", [])) & FATAL_XIDS)
    if fatal:
        health.mark("bad", f"Xid {', '.join(map(str, fatal))} in the kernel log")
    if driver and gpus[0]["driver"] != driver:
        health.mark("degraded", f"driver {gpus[0]['driver']} differs from the other nodes' {driver}")


def _assess_storage(health: NodeHealth, f: dict) -> None:
    if not f["mounted"]:
        health.mark("bad", "/data is not mounted")
    elif not f["writable"]:
        health.mark("bad", "/data is not writable")
    if f["free_gb"] < MIN_FREE_GB["bad"]:
        health.mark("bad", f"{f['free_gb']:.1f} GB free on /data")
    elif f["free_gb"] < MIN_FREE_GB["degraded"]:
        health.mark("degraded", f"{f['free_gb']:.1f} GB free on /data")


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


def fit_to_train(health: Sequence[NodeHealth]) -> bool:
    return all(h.verdict != "bad" for h in health)


def as_json(health: Sequence[NodeHealth], **extra) -> str:
    return json.dumps({"fit_to_train": fit_to_train(health), "nodes": [asdict(h) for h in health], **extra}, indent=2)


def expected_gpus(instance_type: str, gpus_per_node: int) -> tuple[int, Optional[str]]:
    """GPU count and model a node should show, from the instance-type table (model None: unknown)."""
    from stacks.instance_types import lookup

    known = lookup(instance_type)
    return (known.gpus, known.gpu) if known else (gpus_per_node, None)


def clock_skew(node_time: float, before: float, after: float) -> float:
    """How far the node's clock is outside the controller's [before, after] window around the probe."""
    return node_time - after if node_time > after else min(node_time - before, 0.0)


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
