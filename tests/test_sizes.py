"""Rooms a reader takes in at once: no module over 400 lines, no function over 60 (tests excepted),
over everything that ships: the CDK app, the laptop side, the tasks, what runs on the nodes, the scripts."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
ROOTS = ("stacks", "clusterops", "fabfile", "assets", "scripts", "app.py")


def python_sources() -> list[Path]:
    found = []
    for name in ROOTS:
        root = REPO / name
        found += [root] if root.is_file() else [p for p in root.rglob("*.py") if "node_modules" not in p.parts]
    return sorted(found)


def long_functions(path: Path) -> list[str]:
    """`name (N lines)` for each function or method longer than the limit, its docstring included."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_the_measure_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "m.py") == [f"long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_module_over_400_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in python_sources()}
    over = [f"{name}: {lines}" for name, lines in sizes.items() if lines > MAX_MODULE_LINES]
    assert not over, "split by concern:\n" + "\n".join(over)


def test_no_function_over_60_lines():
    found = [f"{p.relative_to(REPO)}: {f}" for p in python_sources() for f in long_functions(p)]
    assert not found, "split these:\n" + "\n".join(found)
