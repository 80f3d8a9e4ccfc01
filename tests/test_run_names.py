"""The run protocol is spelled once: no source file but cluster_node/protocol/rundir.py and clusterdir.py (and
protocol.py, which tabulates them) names a run-directory or /data/.cluster file. A new reader imports the
name from there; a literal elsewhere is how hostfile came to be written in two places and parsed in three."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

from cluster_node.protocol import clusterdir, rundir

NODE = REPO / "assets" / "cluster_node"
SPELLERS = {NODE / "protocol" / "rundir.py", NODE / "protocol" / "clusterdir.py", NODE / "protocol" / "table.py"}
# Directory words too common to grep; their paths go through rundir's and clusterdir's helpers.
GENERIC = {"runs", "ranks", "stacks", "probes", "checkpoints", "tensorboard", "eval", "ssh", "ready", "heartbeat"}
GENERIC |= {"autostop", "busy", ".cluster", "specs"}
# Shell that has no Python to import from, each with why; the test fails when an entry is no longer needed.
SHELL_NEEDS = {
    # runs before any Python on a fresh node: makes the cluster SSH identity under a mkdir lock
    ("assets/docker/cluster-identity.sh", "SSH_LOCK"),
    # the entrypoint's restart loops append the watchers' output, crashes included, to their logs
    ("assets/docker/entrypoint.sh", "AUTOSTOP_NODE_LOG"),
    ("assets/docker/entrypoint.sh", "SPOT_NODE_LOG"),
    # the demo translates with the fetched run's best checkpoint (a local path, as a user types it)
    ("scripts/demo.sh", "BEST_CHECKPOINT"),
}


def guarded_names() -> dict[str, re.Pattern]:
    """The modules' file names, a `{field}` becoming a wildcard; only names distinctive enough to grep."""
    names = {}
    for attr, value in [*vars(rundir).items(), *vars(clusterdir).items()]:
        if not attr.isupper() or not isinstance(value, str) or value in GENERIC:
            continue
        distinctive = re.search(r"[.\-_]", value) or value.isupper()
        if not re.fullmatch(r"[\w.{}:*-]+", value) or not distinctive or attr == "URGENT_STOP_WORD":
            continue
        body = re.sub(r"\\\{[^}]*\\\}|\\\*", r"[^/\\s\"']*", re.escape(value))
        if body.startswith(r"[^/"):
            continue  # a name that is all field (BUSY_MARKER's {host}-{pid}.json): not greppable
        names[attr] = re.compile(rf"(^|[/\s'\"=]){body}($|[/\s'\";)])")
    return names


def python_literals(path: Path) -> list[tuple[int, str]]:
    """Every string constant but docstrings (f-string parts included): comments and docs may name files."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def shell_lines(path: Path) -> list[tuple[int, str]]:
    lines = enumerate(path.read_text().splitlines(), 1)
    return [(n, line.split(" #")[0]) for n, line in lines if not line.lstrip().startswith("#")]


def sources() -> list[Path]:
    roots = [REPO / d for d in ("stacks", "clusterops", "fabfile", "assets", "scripts")] + [REPO / "app.py"]
    found = []
    for root in roots:
        paths = [root] if root.is_file() else [*root.rglob("*.py"), *root.rglob("*.sh"), *root.rglob("Dockerfile")]
        found += [p for p in paths if p not in SPELLERS and "node_modules" not in p.parts]
    return sorted(found)


def spellings() -> set[tuple[str, int, str]]:
    names = guarded_names()
    found = set()
    for path in sources():
        lines = python_literals(path) if path.suffix == ".py" else shell_lines(path)
        for lineno, text in lines:
            where = str(path.relative_to(REPO))
            found |= {(where, lineno, attr) for attr, pattern in names.items() if pattern.search(text)}
    return found


def test_the_guard_knows_the_names_and_finds_a_spelling():
    names = guarded_names()
    assert {"RUN_STATUS", "PROGRESS", "STOP", "SPEC", "ACTIVE", "EVAL_TEXT", "LINK_JSON", "SSH_LOCK"} <= set(names)
    assert names["EVAL_TEXT"].search("/step_00000010.bleu.txt") and names["SUMMARY"].search("/summary.json")
    assert not names["SUMMARY"].search("summary.jsonl") and not names["STOP"].search("STOPPED")


def test_only_the_run_directory_module_spells_a_run_file_name():
    found = spellings()
    stray = sorted(f"{where}:{line}: {attr}" for where, line, attr in found if (where, attr) not in SHELL_NEEDS)
    assert not stray, "import these from cluster_node.protocol.rundir (or clusterdir):\n" + "\n".join(stray)
    stale = SHELL_NEEDS - {(where, attr) for where, _, attr in found}
    assert not stale, f"no longer spelled there: drop from SHELL_NEEDS: {sorted(stale)}"
