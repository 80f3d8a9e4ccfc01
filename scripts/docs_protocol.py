"""Writes the run-directory protocol table into docs/architecture.md, between its marker comments, from
cluster_node.protocol.table.protocol_table(). `--check` only compares (exit 1 when the doc is stale);
tests/test_docs.py runs the same comparison."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster_node.protocol.table import protocol_table

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
BEGIN = "<!-- protocol-table:begin"
END = "<!-- protocol-table:end -->"


def split(text: str) -> tuple[str, str, str]:
    """(before and the begin marker's line, the table, the end marker and after)."""
    start = text.index(BEGIN)
    head_end = text.index("\n", start) + 1
    tail_start = text.index(END, head_end)
    return text[:head_end], text[head_end:tail_start], text[tail_start:]


def rendered(text: str) -> str:
    head, _, tail = split(text)
    return head + protocol_table() + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when the doc differs")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    new = rendered(text)
    if args.check:
        if new != text:
            print(f"{args.doc}: the protocol table differs from protocol_table(); run {sys.argv[0]}")
            return 1
        return 0
    if new != text:
        args.doc.write_text(new)
        print(f"{args.doc}: protocol table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
