"""The run protocol as a table: every file of rundir.py and clusterdir.py, its writer, readers and format.
protocol_table() renders it for docs/architecture.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from cluster_node.protocol import clusterdir as cd
from cluster_node.protocol import rundir as rd


@dataclass(frozen=True)
class ProtocolFile:
    """One row of the protocol: `path` relative to DATA/runs/NAME (`where` = run), DATA/runs (runs) or
    DATA/.cluster (cluster)."""

    path: str
    where: str
    format: str
    writers: str
    readers: str
    record: Optional[str] = None


def _run(path: str, format: str, writers: str, readers: str, record: Optional[type] = None) -> ProtocolFile:
    return ProtocolFile(path, "run", format, writers, readers, record.__name__ if record else None)


def _at(where: str, path: str, format: str, writers: str, readers: str) -> ProtocolFile:
    return ProtocolFile(path, where, format, writers, readers)


_SUPERVISOR = "supervisor"
FILES: tuple[ProtocolFile, ...] = (
    _run(
        rd.RUN_STATUS,
        "JSON RunStatus",
        "supervisor",
        "fab logs/stop/status/runs/fetch/drill, autostop",
        rd.RunStatus,
    ),
    _run(
        rd.PROGRESS,
        "JSON Progress",
        "train.callbacks.ProgressFile (rank 0)",
        "supervisor, fab, autostop, spotwatch",
        rd.Progress,
    ),
    _run(
        rd.SUMMARY,
        "JSON Summary",
        "trainer (rank 0); supervisor adds `goodput` at the end (cluster_node.supervisor.goodput)",
        "fab status/runs/report/fetch, local cluster",
        rd.Summary,
    ),
    _run(
        rd.CONFIG,
        "JSON TrainConfig.to_dict()",
        "train.train.compose (rank 0)",
        "train.train (resume), supervisor, fab",
    ),
    _run(rd.RESTARTS, "JSON list of Restart", "supervisor", "supervisor, fab status/logs/drill", rd.Restart),
    _run(rd.HANGS, "JSON list of Hang", "supervisor", "tests", rd.Hang),
    _run(rd.INTERRUPTIONS, "JSON list of Interruption", "spotwatch (lockf)", "supervisor", rd.Interruption),
    _run(rd.INTERRUPTIONS_LOCK, "empty; lockf", "spotwatch", "spotwatch"),
    _run(
        rd.SPEC, "JSON RunSpec (cluster_node.protocol.spec)", "fab train; supervisor (restart)", "supervisor, autostop"
    ),
    _run(f"{rd.SPECS}/{rd.SPEC_ATTEMPT}", "JSON RunSpec of attempt N", "fab train; supervisor", "people"),
    _run(
        rd.STOP,
        "lines appended: `fab stop`, `now: spot: nodeN ...` (recorded in interruptions.json first), or the budget's "
        "`now: WHY` (any `now` line: no eval)",
        "fab stop; spotwatch; supervisor (--budget-usd)",
        "trainer (rank 0); supervisor (a worker's notice during a restart)",
    ),
    _run(rd.FORCED, "empty", "fab stop --force", "supervisor"),
    _run(rd.STOP_TAKEN, "STOP's lines, while the supervisor reads them", "supervisor (restarting)", "supervisor"),
    _run(rd.LAUNCHER_PID, "the supervisor's pid on the head node", "supervisor", "fab (kill -0 on the head)"),
    _run(rd.MPIRUN_PID, "pid on the head node", "supervisor", "fab stop --force"),
    _run(rd.TRAIN_LOG, "text, appended", "mpirun, supervisor, spotwatch", "fab logs/fetch/drill, supervisor"),
    _run(rd.LAUNCHER_LOG, "text", "the supervisor's own output: each attempt's whole mpirun line", "people"),
    _run(
        rd.PROBE_SH,
        "one line: python -m cluster_node.programs.probe",
        "fab train (upload)",
        "supervisor (ssh HOST bash -s)",
    ),
    _run(
        f"{rd.RANKS}/{rd.RANK_BEAT}", "`STEP PID HOST` (RankBeat); mtime", "train.callbacks (every rank)", _SUPERVISOR
    ),
    _run(
        f"{rd.STACKS}/{rd.RANK_STACK}",
        "faulthandler stacks on SIGUSR2",
        "train.callbacks (every rank)",
        "supervisor, people",
    ),
    _run(
        f"{rd.STACKS}/{rd.HOST_STATES}",
        "`PID STATE HOST` lines",
        "cluster_node.supervisor.hang dump (ssh)",
        "supervisor",
    ),
    _run(f"{rd.STACKS}/{rd.PY_SPY}", "py-spy dump", "cluster_node.supervisor.hang dump", "people"),
    _run(rd.HANG_STACKS, "the attempt's stacks/ after a hang", "supervisor (rename)", "people"),
    _run(f"{rd.PROBES}/HOST", "probe output, JSON on the last line", "supervisor", "supervisor (restart_plan)"),
    _run(
        f"{rd.CHECKPOINTS}/{rd.CHECKPOINT}",
        "torch state",
        "train.checkpoint (rank 0)",
        "trainer, supervisor, fab fetch",
    ),
    _run(f"{rd.CHECKPOINTS}/{rd.BEST_CHECKPOINT}", "torch state", "train.checkpoint (rank 0)", "fab fetch"),
    _run(rd.TENSORBOARD, "TensorBoard events", "trainer (rank 0)", "fab tensorboard"),
    _run(f"{rd.EVAL}/{rd.EVAL_TEXT}", "text: the eval's samples or translations", "trainer (rank 0)", "fab fetch"),
    _run(rd.REPORT_MD, "Markdown", "fab report", "fab fetch"),
    _run(rd.PREDICTIONS, "JSON list: predicted vs measured step", "fab report --verify", "fab report"),
    _run(
        rd.PHASES,
        "JSON lines of phases.Phase (lockf)",
        "supervisor; train.train, train.callbacks.PhaseMarks (rank 0)",
        "fab report/runs/drill (cluster_node.supervisor.goodput)",
    ),
    _run(rd.GOODPUT_PNG, "PNG", "fab report", "fab fetch"),
    _run(rd.BREAKDOWN_PNG, "PNG", "fab report", "fab fetch"),
    _run(rd.SCALING_PNG, "PNG", "fab report", "fab fetch"),
    _run(rd.FETCHED, "empty marker", "fab fetch", "fab local.down"),
    _run(rd.SEGMENTS, "JSON list of Segment", "supervisor (at its end)", "fab runs (wall time)", rd.Segment),
    _run(
        rd.BUDGET,
        "JSON budget.Spend: the limit, the spend over every segment, where CloudWatch's EFS I/O stops (io_to) "
        "and the launch-time rate's estimate after it (io_estimate: a resume measures it instead)",
        "supervisor (--budget-usd, every poll)",
        "fab train (resume)",
    ),
    _at("runs", rd.ACTIVE, "the head's run path", "fab train; removed by the supervisor", "fab, autostop, spotwatch"),
    _at(
        "head",
        rd.LAUNCH_LOCK,
        "empty; flock while a launch starts",
        "cluster_node.programs.start",
        "cluster_node.programs.start",
    ),
    _at(
        "node",
        f"{rd.SNAPSHOT_ROOT}/NAME/{rd.SNAPSHOT}",
        f"torch state, the newest every --snapshot-seconds (the root: ${rd.SNAPSHOT_DIR_ENV} when set)",
        "train.snapshot (local rank 0 of each node)",
        "trainer (resume, when every rank holds the same step); probe (the step held); programs.snapshots",
    ),
    _at("runs", rd.CHECK_RUN, "fab check's run directory", "fab check", "fab check"),
    _at("runs", f"{rd.SCALE_DIR}/{rd.SCALE_JSON}", "JSON", "fab scale", "fab scale"),
    _at("runs", f"{rd.SCALE_DIR}/{rd.SCALE_MD}", "Markdown", "fab scale", "people"),
    _at(
        "cluster", cd.SSH_DIR, "the cluster's SSH identity", "cluster-identity.sh", "entrypoint.sh, mpirun, supervisor"
    ),
    _at("cluster", cd.SSH_LOCK, "flock", "cluster-identity.sh", "cluster-identity.sh"),
    _at(
        "cluster",
        f"{cd.READY_DIR}/{cd.NODE_MARK}",
        cd.READY_FORMAT,
        "node-bootstrap.sh",
        "node_status (fab status), the idle watchdog",
    ),
    _at(
        "cluster", f"{cd.DEPLOY_DIR}/{cd.NODE_MARK}", cd.DEPLOY_FORMAT, "node-bootstrap.sh", "node_status (fab status)"
    ),
    _at("cluster", f"{cd.HEARTBEAT_DIR}/{cd.NODE_JSON}", "JSON NodeHeartbeat", "autostop", "autostop (the others)"),
    _at("cluster", f"{cd.AUTOSTOP_DIR}/{cd.NODE_JSON}", "JSON idle_state.IdleState", "autostop", "autostop"),
    _at("cluster", cd.AUTOSTOP_LOG, "text", "autostop", "people"),
    _at("cluster", cd.AUTOSTOP_NODE_LOG, "text", "entrypoint.sh", "people"),
    _at("cluster", cd.SPOT_NODE_LOG, "text", "entrypoint.sh", "people"),
    _at(
        "cluster",
        f"{cd.BUSY_DIR}/{cd.BUSY_MARKER}",
        "JSON BusyMarker",
        "prepare.py; fab fetch (fab-ID.json)",
        "autostop",
    ),
    _at("cluster", cd.LINK_JSON, "JSON (linkcheck.summary)", "fab check", "fab report, fab check"),
    _at("cluster", cd.TRANSPORT_JSON, "JSON (health.transport_verdict)", "fab check", "fab train"),
    _at(
        "cluster",
        cd.HEALTH_PROBE_FILE,
        "the probe's write test",
        "cluster_node.programs.probe",
        "cluster_node.programs.probe",
    ),
    _at("cluster", cd.DRILL_FILL, "--mb of zeros; removed when the drill ends", "fab drill fill-data", "nobody"),
    _at(
        "node",
        f"STAGE_TO/{cd.STAGING_MARKER}",
        "empty: a staging under way or cut off",
        "prepare.py --stage-to (train.imagenet.stage)",
        "fab train --data, cluster_node.programs.probe --copy",
    ),
    _at(
        "node",
        f"STAGE_TO/{cd.STAGED_MARKER}",
        "JSON files, bytes, source: a finished staging",
        "prepare.py --stage-to (train.imagenet.stage)",
        "fab train --data (the same on every node), cluster_node.programs.probe --copy",
    ),
)

_WHERE = {
    "head": "",
    "node": "",
    "run": f"DATA/{rd.RUNS}/NAME/",
    "runs": f"DATA/{rd.RUNS}/",
    "cluster": f"DATA/{cd.CLUSTER}/",
}


def protocol_table(files: Iterable[ProtocolFile] = FILES) -> str:
    """The protocol as a Markdown table, for docs/architecture.md."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| name | writer | readers | format |", "|---|---|---|---|"]
    for f in files:
        name = f"`{_WHERE[f.where]}{f.path}`"
        rows.append(f"| {cell(name)} | {cell(f.writers)} | {cell(f.readers)} | {cell(f.format)} |")
    return "\n".join(rows) + "\n"
