"""Operate the GPU training cluster (AWS or the emulated local one). `fab --list`; `fab --help TASK`.

Typical session:  fab local.up --nodes 2  ->  fab data  ->  fab train --follow  ->  fab fetch  ->  fab local.down
On AWS:           fab preflight -> npx cdk deploy -> fab inventory -> fab status -> fab data ... -> fab destroy

One module per concern; this file only builds the collection (Invoke's "namespace" pattern).
"""

import atexit
import os
import sys
from pathlib import Path

# Invoke puts fabfile/ itself on sys.path (its modules would shadow top-level names such as `aws`), which
# no install undoes. And the checkout that holds this fabfile goes first: the editable install (setup.sh)
# serves one checkout, and worktrees that share its venv must still run their own clusterops and stacks.
_PACKAGE_DIR, _PROJECT_DIR = str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)
sys.path[:] = [_PROJECT_DIR] + [entry for entry in sys.path if entry not in (_PACKAGE_DIR, _PROJECT_DIR)]


def _reader_left() -> None:
    """`fab runs | head -1`: the reader went away; end quietly as a Unix filter does, no traceback (Python's
    signal docs, "Note on SIGPIPE": point stdout at /dev/null for the final flush)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _excepthook(kind, value, traceback, previous=sys.excepthook) -> None:
    if issubclass(kind, BrokenPipeError):
        return _reader_left()  # exit status 1, as for any unhandled error
    previous(kind, value, traceback)


def _flush_or_leave() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_left()


sys.excepthook = _excepthook
atexit.register(_flush_or_leave)

from invoke import Collection  # noqa: E402

from . import analysis, aws, cluster, drill, local, runs  # noqa: E402

ns = Collection(
    aws.preflight,
    aws.cost,
    aws.audit,
    aws.destroy,
    aws.release_spot,
    aws.start,
    aws.stop_cluster,
    aws.inventory,
    cluster.status,
    cluster.check,
    cluster.data,
    cluster.sync,
    runs.train,
    runs.logs,
    runs.stop,
    cluster.tensorboard,
    cluster.monitor,
    runs.fetch,
    analysis.report,
    analysis.runs,
    analysis.scale,
    analysis.plan,
    cluster.ssh,
    drill.drill,
    local.local,
)
