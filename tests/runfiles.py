"""Tests' run files as the laptop reads them (clusterops.nodes.records.RunFiles), from the JSON the run's
files hold; a run-status given in part is completed as the supervisor writes it."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

from conftest import REPO

from cluster_node.programs import runs
from cluster_node.protocol import rundir
from clusterops.inventory import Inventory
from clusterops.nodes import records as noderecords

STATUS = {"exit_code": None, "reason": "", "time": "2026-01-01T00:00:00Z", "head": "node0"}


def full_status(**fields: Any) -> dict:
    """A run-status.json as the supervisor writes it, with `fields` over the defaults."""
    return {**STATUS, **fields}


def run_files(run: str = "", status: Optional[dict] = None, **roles: Any) -> noderecords.RunFiles:
    """RunFiles from JSON values by role (progress=..., summary=..., restarts=[...], ...)."""
    names = {role: name for name, (role, _) in noderecords.ROLES.items()}
    files = {names[role]: value for role, value in roles.items()}
    if status is not None:
        files[rundir.RUN_STATUS] = {**STATUS, **status}
    return noderecords.decode({"run": run, "files": files})


def here(inventory: Inventory) -> Inventory:
    """The inventory with this machine's Python and checkout: node programs run here (a local 'head')."""
    return dataclasses.replace(inventory, python=sys.executable, code_dir=str(REPO / "assets" / "train"))


def read_here(_connection, _inventory, run_dir: str, *names: str, strict: bool = False, **kwargs: Any):
    """noderecords.read without SSH: cluster_node.programs.runs.files in this process (monkeypatch it in)."""
    lenient = kwargs.get("lenient", ())
    return noderecords.decode(runs.files(Path(run_dir), names), strict, lenient)
