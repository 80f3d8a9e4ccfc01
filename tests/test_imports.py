"""The import graph, read from the source (AST), not from what happens to be imported: no cycle between
modules, and no upward import. The node side (cluster_node) imports only the standard library and
itself (boto3 in the idle watchdog); the trainer (train) may import cluster_node but nothing of the
laptop (clusterops, fabfile) or the CDK app (stacks). (test_fabfile checks that no fab task module
imports another.)"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from conftest import REPO

PACKAGES = {"stacks": REPO / "stacks", "clusterops": REPO / "clusterops", "fabfile": REPO / "fabfile"}
PACKAGES |= {"cluster_node": REPO / "assets" / "cluster_node", "train": REPO / "assets" / "train"}
LAPTOP = {"stacks", "clusterops", "fabfile"}
# The node side's imports beyond the standard library, each with why.
NODE_LIBRARIES = {
    # the idle watchdog stops the cluster's instances through EC2
    ("cluster_node.daemons.autostop.watchdog", "boto3"),
    # the budget meter sums the run's EFS I/O from CloudWatch (imported when asked; the training image has boto3)
    ("cluster_node.supervisor.efsio", "boto3"),
    ("cluster_node.supervisor.efsio", "botocore"),
    # the budget meter reads which of the cluster's nodes bill from EC2's instance state (imported when asked)
    ("cluster_node.supervisor.ec2state", "boto3"),
    ("cluster_node.supervisor.ec2state", "botocore"),
    # the health probe reports the torch, CUDA and NCCL the ranks will load (in a try: a broken torch is a finding)
    ("cluster_node.programs.probe", "torch"),
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the five packages and app.py."""
    found = {"app": REPO / "app.py"}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never executed)."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded |= {id(inner) for inner in ast.walk(node)}
    return guarded


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """What module `name` imports (function-level imports too: they cycle at call time): the modules of
    ours by dotted name, anything else by its top-level name."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = _type_checking_only(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            subs = {f"{base}.{alias.name}" for alias in node.names}
            out |= {sub for sub in subs if sub in known} or {base}
    return {_ours(target, known) for target in out}


def _ours(target: str, known: dict[str, Path]) -> str:
    """`target` itself when it is one of our modules, its longest known prefix when it names a name in
    one of them, else its top-level name (a library)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return parts[0]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in edges:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_and_resolves_relative_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    known = modules()
    hang = imported(
        "cluster_node.supervisor.hang", known["cluster_node.supervisor.hang"], known
    )  # from . import rundir
    watchdog = imported(
        "cluster_node.daemons.autostop.watchdog", known["cluster_node.daemons.autostop.watchdog"], known
    )
    assert (
        "cluster_node.protocol.rundir" in hang and "cluster_node.protocol.clusterdir" in watchdog
    )  # from .. import clusterdir
    assert "clusterops.nodes.remote" in imported("clusterops.nodes.probe", known["clusterops.nodes.probe"], known)


def test_no_import_cycle():
    assert sys.getrecursionlimit() > len(modules())
    found = cycles(graph())
    assert not found, "import cycles (break each by moving the shared piece down):\n" + "\n".join(map(str, found))


def test_no_upward_import():
    libraries = set(sys.stdlib_module_names)
    edges = graph()
    assert all(target in edges[name] for name, target in NODE_LIBRARIES), "an allowance no longer needed"
    bad = []
    for name, targets in edges.items():
        top = name.split(".")[0]
        if top == "cluster_node":
            bad += [f"{name} -> {t}" for t in targets if t.split(".")[0] not in libraries | {"cluster_node"}]
        elif top == "train":
            bad += [f"{name} -> {t}" for t in targets if t.split(".")[0] in LAPTOP]
    bad = [line for line in bad if tuple(line.split(" -> ")) not in NODE_LIBRARIES]
    assert not bad, "upward imports (the node side imports the standard library and itself):\n" + "\n".join(sorted(bad))


# The subpackages by noun (issue 31), each on a layer: a module imports its own subpackage and the layers
# below it, never a sibling on its own layer or a layer above (the base imports no subpackage).
LAYERS = {
    "clusterops": {"": 0, "aws": 1, "local": 1, "nodes": 1, "predict": 2, "run": 3},
    "cluster_node": {"": 0, "protocol": 0, "programs": 1, "supervisor": 2, "daemons": 2},
}


def _place(dotted: str) -> tuple[str, str]:
    """(package, subpackage) of a module; "" for the package's base modules."""
    top, *rest = dotted.split(".")
    sub = rest[0] if len(rest) > 1 and rest[0] in LAYERS.get(top, {}) else ""
    return top, sub


def downward(name: str, target: str) -> bool:
    (top, sub), (target_top, target_sub) = _place(name), _place(target)
    if top != target_top or top not in LAYERS or sub == target_sub:
        return True
    layers = LAYERS[top]
    return layers[target_sub] < layers[sub] or (target_sub in ("", "protocol") and layers[target_sub] == layers[sub])


def test_the_layer_rule_refuses_a_sibling_and_an_upward_arrow():
    assert downward("clusterops.run.launch", "clusterops.nodes.remote")
    assert downward("clusterops.nodes.remote", "clusterops.inventory")
    assert not downward("clusterops.nodes.view", "clusterops.run.launch")
    assert not downward("clusterops.aws.audit", "clusterops.local.cluster")
    assert not downward("clusterops.inventory", "clusterops.nodes.remote")
    assert downward("cluster_node.protocol.rundir", "cluster_node.tools")
    assert not downward("cluster_node.programs.runs", "cluster_node.supervisor.goodput")


def test_every_subpackage_imports_only_its_own_and_the_layers_below():
    known = set(LAYERS["clusterops"]) | set(LAYERS["cluster_node"])
    subpackages = {p.parent.name for top in ("clusterops", "cluster_node") for p in PACKAGES[top].glob("*/__init__.py")}
    assert subpackages - {"autostop"} <= known, f"give these a layer in LAYERS: {subpackages - known}"
    bad = [f"{name} -> {t}" for name, targets in graph().items() for t in targets if not downward(name, t)]
    assert not bad, "arrows running back up or sideways (move the shared piece down):\n" + "\n".join(sorted(bad))
