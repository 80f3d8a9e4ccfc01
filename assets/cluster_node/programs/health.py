"""Node health verdicts: one probe's facts per node in, a verdict per node (ok, degraded, bad) with its
reasons out. `bad` means the node must not train; `degraded` trains, with a warning. Pure: `fab check` and
`fab train` on the laptop and the supervisor's restart planning on the head node judge with the same code."""

from __future__ import annotations

import json
import statistics
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
    if "nccl" in f and f["nccl"] is None:  # versions(): torch loaded, and found no CUDA device
        seen = f"torch finds no CUDA device though nvidia-smi lists {len(gpus)}"
        health.mark("bad", f"{seen}: ranks would train on the CPU")
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
    copy = f.get("copy") or {}
    if copy.get("state") in ("missing", "unfinished"):  # a rank here would read no data, or other files
        what = "no copy" if copy["state"] == "missing" else "a staging cut off"
        health.mark("bad", f"{what} at {copy['path']} (the run's --data; a stop erases the instance store)")


def fit_to_train(health: Sequence[NodeHealth]) -> bool:
    return all(h.verdict != "bad" for h in health)


def as_json(health: Sequence[NodeHealth], **extra) -> str:
    return json.dumps({"fit_to_train": fit_to_train(health), "nodes": [asdict(h) for h in health], **extra}, indent=2)


def clock_skew(node_time: float, before: float, after: float) -> float:
    """How far the node's clock is outside the controller's [before, after] window around the probe."""
    return node_time - after if node_time > after else min(node_time - before, 0.0)
