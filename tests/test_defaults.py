"""One default per knob (issue 31 §5): a knob's default is a literal in one place (its definition), and every
other place that needs it names that one: the hang threshold was spelled in five places, fab plan's root
volume beside the stack's. Read from the source (AST): a literal default of a knob's name in a signature, a
dataclass field, a keyword argument or a settings dict."""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict

import pytest
from conftest import REPO

ROOTS = [REPO / "clusterops", REPO / "fabfile", REPO / "stacks", REPO / "assets" / "cluster_node"]
# The names a knob goes by, from the flag the user types to the field the supervisor reads.
KNOBS = {
    "hang threshold": {"hang_seconds", "hang_floor"},
    "stall limit": {"stall_minutes", "stall"},
    "start limit": {"start_minutes", "start"},
    "rendezvous port": {"master_port"},
    "restarts": {"max_restarts"},
    "min nodes": {"min_nodes"},
    "budget margin": {"budget_margin", "DEFAULT_MARGIN"},
    "root volume": {"root_gb", "root_volume_gb"},
    "recipe": {"recipe"},
    "all-reduce payload": {"mb", "payload", "ALLREDUCE_MB"},
    "seconds per pair": {"seconds", "per_pair", "PAIR_SECONDS"},
    "drill's fault time": {"seconds"},
    "drill's rate": {"rate"},
    "drill's file": {"mb"},
    "drill's wait": {"wait"},
    "emulated nodes": {"nodes"},
    "emulated slots": {"slots"},
    "emulated subnet": {"subnet"},
    "plan's node counts": {"max_nodes"},
    "monitor's sample": {"interval", "SAMPLE_SECONDS"},
    "tensorboard's local port": {"port", "LOCAL_PORT"},
    "scale's node counts": {"nodes", "SCALE_NODE_COUNTS"},
    "scale's steps": {"steps", "SCALE_STEPS"},
    "scale's repeats": {"repeat", "repeats", "SCALE_REPEATS"},
}
# A knob whose names other tasks use for knobs of their own (fab drill's --mb and --seconds): read only where it
# lives.
CHECK, DRILL = ("fabfile/cluster.py", "clusterops/run/checkup.py"), ("fabfile/drill.py", "clusterops/run/drill.py")
LOCAL = ("fabfile/local.py", "clusterops/local/cluster.py")
SCALE = ("fabfile/analysis.py", "clusterops/run/analysis.py")
WHERE = {
    "all-reduce payload": CHECK,
    "seconds per pair": CHECK,
    "drill's fault time": DRILL,
    "drill's rate": DRILL,
    "drill's file": DRILL,
    "drill's wait": DRILL,
    "emulated nodes": LOCAL,
    "emulated slots": LOCAL,
    "emulated subnet": LOCAL,
    "plan's node counts": ("fabfile/analysis.py", "clusterops/run/planner.py"),
    "monitor's sample": ("fabfile/cluster.py", "clusterops/nodes/view.py"),
    "tensorboard's local port": ("fabfile/cluster.py", "clusterops/run/tensorboard.py"),
    "scale's node counts": SCALE,
    "scale's steps": SCALE,
    "scale's repeats": SCALE,
}


def _literal(node) -> bool:
    """A number other than 0 (0 is "none", not a default), a number or a list of them in a string (a task's
    option: "30", "1,2"), a recipe's name, or a help text that spells a number as the default ("(default 60)",
    "(fabric.yaml: 10)")."""
    from clusterops.run.launch import RECIPES

    if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
        return False
    if isinstance(node.value, (int, float)):
        return node.value != 0
    if not isinstance(node.value, str):
        return False
    text = node.value
    numeric = re.fullmatch(r"\d+(\.\d+)?(,\d+)*", text) is not None and text.strip("0,.") != ""
    return numeric or text in RECIPES or re.search(r"(default|fabric\.yaml:) \d", text) is not None


@functools.cache  # one read of the sources for all the knobs' tests
def literal_defaults() -> dict[str, list[str]]:
    """knob -> where a literal default of it is written (file:line)."""
    names: dict[str, list[str]] = defaultdict(list)  # a name can be two tasks' knobs (fab check's and drill's --mb)
    for knob, aliases in KNOBS.items():
        for name in aliases:
            names[name].append(knob)
    found: dict[str, list[str]] = defaultdict(list)
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            where = path.relative_to(REPO)
            for node in ast.walk(ast.parse(path.read_text())):
                pairs: list[tuple[str, ast.AST]] = []
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    positional = node.args.posonlyargs + node.args.args
                    pairs += zip([a.arg for a in positional[-len(node.args.defaults) :]], node.args.defaults)
                    pairs += [(a.arg, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                    pairs.append((node.target.id, node.value))
                elif isinstance(node, ast.Assign):
                    pairs += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
                    for t in node.targets:  # A, B = 1, 2
                        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                            pairs += [(n.id, v) for n, v in zip(t.elts, node.value.elts) if isinstance(n, ast.Name)]
                elif isinstance(node, ast.Call):
                    pairs += [(k.arg, k.value) for k in node.keywords if k.arg]
                elif isinstance(node, ast.Dict):
                    pairs += [(k.value, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)]
                for name, value in pairs:
                    for knob in names.get(name, []):
                        if _literal(value) and str(where) in WHERE.get(knob, (str(where),)):
                            found[knob].append(f"{where}:{value.lineno}")
    return found


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_each_knobs_default_is_written_once(knob):
    assert len(literal_defaults()[knob]) <= 1, f"{knob}: a literal default in {literal_defaults()[knob]}"
