"""A run's files on the head node as the protocol's records: `python -m cluster_node.programs.runs files` reads them
there (any number in one round trip, in place of `cat` over SSH) and prints JSON; this decodes it into
cluster_node.protocol.rundir's records (as SkyPilot's skylet code generators run a module on the node and decode
what it prints). A missing file is None (a list file: ()); a file that is not its record is one error
naming the file. config.json has no record (the trainer's settings): it stays a dict."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional

from fabric import Connection

from cluster_node.protocol import rundir
from cluster_node.protocol.phases import Phase
from cluster_node.protocol.rundir import Hang, Interruption, Progress, Restart, RunState, RunStatus, Segment, Summary
from cluster_node.protocol.spec import RunSpec
from cluster_node.supervisor.budget import Spend
from clusterops.inventory import Inventory
from clusterops.nodes import command as nodecmd
from clusterops.nodes import remote


class RecordsError(remote.RemoteError):
    """A run file that is not its record (or, read strictly, not JSON)."""


@dataclass(frozen=True)
class RunFiles:
    """The run files read, by role; the ones not asked for (or missing) are None or ()."""

    run: str  # the run directory (a run's name in `fab runs`' listing)
    status: Optional[RunStatus] = None
    progress: Optional[Progress] = None
    summary: Optional[Summary] = None
    config: dict[str, Any] = field(default_factory=dict)  # config.json: the trainer's settings, no record
    restarts: tuple[Restart, ...] = ()
    hangs: tuple[Hang, ...] = ()
    segments: tuple[Segment, ...] = ()
    interruptions: tuple[Interruption, ...] = ()
    phases: tuple[Phase, ...] = ()
    spend: Optional[Spend] = None
    spec: Optional[RunSpec] = None

    @property
    def state(self) -> Optional[str]:
        """run-status.json's state; None before the supervisor wrote one."""
        return self.status.state if self.status else None

    @property
    def running(self) -> bool:
        """No end recorded yet (a run whose supervisor has not written its status counts as running)."""
        return self.state in (None, RunState.RUNNING)


# file name -> (the RunFiles field, its record); a list file's field is a tuple of records.
ROLES: dict[str, tuple[str, Any]] = {
    rundir.RUN_STATUS: ("status", RunStatus),
    rundir.PROGRESS: ("progress", Progress),
    rundir.SUMMARY: ("summary", Summary),
    rundir.CONFIG: ("config", None),
    rundir.RESTARTS: ("restarts", Restart),
    rundir.HANGS: ("hangs", Hang),
    rundir.SEGMENTS: ("segments", Segment),
    rundir.INTERRUPTIONS: ("interruptions", Interruption),
    rundir.PHASES: ("phases", Phase),
    rundir.BUDGET: ("spend", Spend),
    rundir.SPEC: ("spec", RunSpec),
}
_LISTS = {rundir.RESTARTS, rundir.HANGS, rundir.SEGMENTS, rundir.INTERRUPTIONS, rundir.PHASES}  # JSON lists


def _record(run: str, name: str, kind: Any, value: Any) -> Any:
    try:
        return kind.from_json(value)
    except rundir.RecordError as error:
        shown = json.dumps(value)[:200]
        raise RecordsError(f"{run}/{name} is not a {kind.__name__} record ({error}): {shown}") from None


def decode(found: Mapping[str, Any], strict: bool = False, lenient: Collection[str] = ()) -> RunFiles:
    """The node's `files` answer as records. `strict`: a file that is not JSON is an error too (else it is
    read as missing, as a half-written file is on the node). `lenient`: names whose file reads as missing
    when it is not its record (else that is an error)."""
    run = str(found.get("run") or "")
    torn = found.get("torn") or {}
    if strict and torn:
        name, why = next(iter(torn.items()))
        raise RecordsError(f"{run}/{name} is not valid JSON ({why})")
    values: dict[str, Any] = {}
    for name, value in (found.get("files") or {}).items():
        role, kind = ROLES[name]
        if value in (None, {}, []):
            continue  # missing or empty: the default
        if kind is None:
            values[role] = value if isinstance(value, dict) else {}
        elif name in _LISTS:
            entries = value if isinstance(value, list) else [value]
            values[role] = tuple(_record(run, name, kind, entry) for entry in entries)
        elif name in lenient:
            try:
                values[role] = kind.from_json(value)
            except rundir.RecordError:
                continue
        else:
            values[role] = _record(run, name, kind, value)
    return RunFiles(run=run, **values)


def _answer(out: str, what: str) -> Any:
    """The JSON on the last line the node program printed."""
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise remote.RemoteError(f"{what} answered {out.strip()[-300:]!r}") from None


def read(
    connection: Connection,
    inventory: Inventory,
    run_dir: str,
    *names: str,
    strict: bool = False,
    timeout: Optional[float] = None,
    lenient: Collection[str] = (),
) -> RunFiles:
    """The run's files NAMES (rundir's names) as records, in one round trip (decode says how)."""
    command = nodecmd.node_command(inventory, "programs.runs", "files", "--run", run_dir, *names)
    return decode(_answer(remote.sh(connection, command, timeout=timeout), f"reading {run_dir}"), strict, lenient)


def _runs_program(inventory: Inventory, what: str) -> str:
    """`cluster_node.programs.runs WHAT --data DATA`, from `fab sync`'s package first, then the image's: the run
    listings agree with each other whichever image the cluster was deployed with."""
    synced = posixpath.join(nodecmd.synced_root(inventory), "train")
    return nodecmd.node_command(inventory, "programs.runs", what, "--data", inventory.data_dir, code_dir=synced)


def overview(connection: Connection, inventory: Inventory) -> Optional[RunFiles]:
    """The active (else latest) run with its status, progress, summary and restarts; None without a run."""
    command = _runs_program(inventory, "overview")
    found = _answer(remote.sh(connection, command), "the run overview")
    return decode(found) if found.get("run") else None


def current_run(connection: Connection, inventory: Inventory) -> Optional[str]:
    """The active (else last launched) run's directory; None without a run. An image built before `current`
    (a cluster deployed by an older checkout, not synced since) answers with its overview's run: the newest
    directory."""
    result = connection.run(_runs_program(inventory, "current"), hide=True, warn=True, in_stream=False)
    if result.exited == 2 and "invalid choice: 'current'" in result.stderr:
        found = overview(connection, inventory)
        return found.run if found else None
    if result.exited != 0:
        raise remote.RemoteError(
            f"{connection.host}: the current run: {(result.stderr or result.stdout).strip()[-300:]}"
        )
    found = _answer(result.stdout, "the current run")
    return found.get("run")


@dataclass(frozen=True)
class AtRisk:
    """What deleting /data would lose (cluster_node.programs.runs at-risk): the run going, the runs not fetched."""

    active: Optional[str]
    unfetched: tuple[str, ...]


def at_risk(connection: Connection, inventory: Inventory) -> AtRisk:
    """Asked of `fab sync`'s package first, then the image's (an older image has no at-risk)."""
    found = _answer(remote.sh(connection, _runs_program(inventory, "at-risk")), "the runs on /data")
    return AtRisk(found.get("active"), tuple(found.get("unfetched") or ()))


def listing(connection: Connection, inventory: Inventory) -> list[RunFiles]:
    """Every run on /data (`run` its name): status, progress, summary, config, segments, phases."""
    return [decode(row) for row in _answer(remote.sh(connection, _runs_program(inventory, "list")), "the run listing")]
