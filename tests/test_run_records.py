"""The laptop reads the run protocol's records as records: no source file in clusterops/ or fabfile/ reads a
field of a run file's record by string key (`status.get("state")`, `summary["steps"]`); it reads the
record's attribute (`status.state`) off what clusterops.nodes.records decoded. A string key is how a field
renamed on the node goes on being read on the laptop as "missing", silently (test_run_names is the same
guard for the file names)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from conftest import REPO

from cluster_node.protocol import phases, rundir, spec
from cluster_node.supervisor import budget

ROOTS = ("clusterops", "fabfile")
# The fields of every record the laptop reads: the run files' (rundir, budget.json, phases.jsonl) and the
# run spec's (spec.json with its limits and budget).
RECORDS = (*rundir.RECORDS, budget.Spend, phases.Phase, spec.RunSpec, spec.Limits, spec.Budget)
FIELDS = {f.name for record in RECORDS for f in dataclasses.fields(record) if f.name != "extra"}

# (file, what the key is read off) that reads no run record, each with why. The test fails when an entry
# is no longer needed.
NOT_RECORDS = {
    # config.json: the trainer's settings (train.config.TrainConfig as JSON); rundir has no record of it
    ("clusterops/run/analysis.py", "config"): "config.json",
    ("clusterops/run/budget.py", "config"): "config.json",
    ("clusterops/run/lifecycle.py", "config"): "config.json",
    ("clusterops/run/resume.py", "config"): "config.json",
    ("clusterops/predict/verify.py", "config"): "config.json",
    ("clusterops/run/planner.py", "config"): "config.json",
    ("fabfile/analysis.py", "settings"): "fabric.yaml's settings",
    ("fabfile/runs.py", "defaults"): "fabric.yaml's settings",
    ("clusterops/cost.py", "TABLE"): "prices.json",
    ("fabfile/aws.py", "TABLE"): "prices.json",
    ("clusterops/inventory.py", "raw"): "inventory.json",
    ("clusterops/local/cluster.py", "current"): "inventory.json",
    ("clusterops/run/lifecycle.py", "result"): "cluster_node.programs.start's answer",
    ("clusterops/run/linkcheck.py", "report"): "iperf3's JSON",
    ("clusterops/run/linkcheck.py", "loads"): "iperf3's JSON",
    ("clusterops/nodes/probe.py", "facts"): "cluster_node.programs.probe's facts",
    ("clusterops/nodes/probe.py", "row"): "a node's row (remote.on_all)",
    ("clusterops/terminal.py", "row"): "a node's row (remote.on_all)",
    ("fabfile/cluster.py", "row"): "a node's row (remote.on_all)",
    ("clusterops/run/dataprep.py", "row"): "a node's row (remote.on_all)",
    ("clusterops/terminal.py", "deploy"): "cluster_node.programs.node_status's deploy timeline",
    ("clusterops/predict/bottleneck.py", "scale"): "scale.json: a `fab scale` series",
    ("clusterops/predict/verify.py", "p"): "predictions.json: fab report --verify's pairs",
    ("clusterops/nodes/records.py", "found"): "cluster_node.programs.runs' answer: the envelope the decoder opens",
}


def source(node: ast.expr) -> str:
    """What a key is read off, by name: `status` in status.get(...), `config` in run.config[...] and in
    (inputs.get("config") or {})[...], `loads` in json.loads(text)[...]."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else source(node.value)
    if isinstance(node, ast.Call):
        func, args = node.func, node.args
        if isinstance(func, ast.Attribute) and func.attr == "get" and args and isinstance(args[0], ast.Constant):
            return str(args[0].value)
        return source(func)
    if isinstance(node, ast.BoolOp):
        return source(node.values[0])
    return "?"


def keyed_reads(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, key, source, text) of every `X[KEY]` and `X.get(KEY, ...)` read whose KEY names a record field."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key, base = node.slice, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            key, base = (node.args or [None])[0], node.func.value
        else:
            continue
        if isinstance(key, ast.Constant) and key.value in FIELDS:
            found.append((node.lineno, str(key.value), source(base), ast.unparse(node)[:80]))
    return found


def reads() -> list[tuple[str, int, str, str, str]]:
    paths = sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py"))
    return [(str(p.relative_to(REPO)), *read) for p in paths for read in keyed_reads(p)]


def test_the_guard_finds_a_keyed_read_and_names_its_source():
    assert {"state", "reason", "step", "steps", "breakdown", "max_restarts", "spent", "event"} <= FIELDS
    code = 'status.get("state"); x = s["ended"] - s["started"]; (inputs.get("config") or {}).get("max_steps")\n'
    code += 'spec["limits"]["stall"]; json.loads(out)["run"]; status.state; row[key]; f(status="reason")\n'
    tree = ast.parse(code)
    path = Path(REPO / "tests" / ".guard-probe.py")
    try:
        path.write_text(ast.unparse(tree))
        found = [(key, where) for _, key, where, _ in keyed_reads(path)]
    finally:
        path.unlink()
    expected = [("state", "status"), ("ended", "s"), ("started", "s"), ("max_steps", "config")]
    expected += [("stall", "limits"), ("limits", "spec"), ("run", "loads")]
    assert sorted(found) == sorted(expected)


def test_the_laptop_reads_no_record_field_by_string_key():
    found = reads()
    stray = [f"{where}:{line}: {text}" for where, line, _, off, text in found if (where, off) not in NOT_RECORDS]
    assert not stray, "read the record's attribute (clusterops.nodes.records decodes the run files):\n" + "\n".join(
        stray
    )
    stale = set(NOT_RECORDS) - {(where, off) for where, _, _, off, _ in found}
    assert not stale, f"no longer read there: drop from NOT_RECORDS: {sorted(stale)}"
