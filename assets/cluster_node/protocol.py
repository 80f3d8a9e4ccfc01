"""The run protocol as a table: every file of rundir.py, its writer, readers and format. protocol_table()
renders it for docs/architecture.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from . import rundir as rd


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


_SUPERVISOR = "launcher.sh + supervise.py"
FILES: tuple[ProtocolFile, ...] = (
    _run(
        rd.RUN_STATUS,
        "JSON RunStatus",
        "launcher.sh `status`",
        "fab logs/stop/status/runs/fetch, autostop",
        rd.RunStatus,
    ),
    _run(
        rd.PROGRESS,
        "JSON Progress",
        "train.callbacks.ProgressFile (rank 0)",
        "launcher.sh, supervise.py, fab, autostop, spotwatch",
        rd.Progress,
    ),
    _run(rd.SUMMARY, "JSON Summary", "trainer (rank 0)", "fab status/runs/report/fetch, local cluster", rd.Summary),
    _run(
        rd.CONFIG,
        "JSON TrainConfig.to_dict()",
        "train.train.compose (rank 0)",
        "train.train (resume), supervise.py, fab",
    ),
    _run(rd.RESTARTS, "JSON list of Restart", "supervise.py plan", "supervise.py, fab status/logs", rd.Restart),
    _run(rd.HANGS, "JSON list of Hang", "supervise.py hang", "tests", rd.Hang),
    _run(rd.INTERRUPTIONS, "JSON list of Interruption", "spotwatch (lockf)", "supervise.py", rd.Interruption),
    _run(rd.INTERRUPTIONS_LOCK, "empty; lockf", "spotwatch", "spotwatch"),
    _run(rd.COMMAND_SH, "shell: exports + exec mpirun", "fab train; supervise.py plan", "launcher.sh"),
    _run(rd.COMMAND_JSON, "JSON list: the first attempt's argv", "fab train", "supervise.py plan"),
    _run(rd.LAUNCH_ENV, "KEY='value' lines (LaunchEnv)", "fab train", "launcher.sh, supervise.py, autostop"),
    _run(rd.HOSTFILE, "`IP slots=N` lines", "fab train; supervise.py plan", "launcher.sh, supervise.py, mpirun"),
    _run(rd.STOP, "empty, or `now: WHY`", "fab stop; spotwatch", "trainer (rank 0)"),
    _run(rd.FORCED, "empty", "fab stop --force", "launcher.sh"),
    _run(rd.LAUNCHER_PID, "pid on the head node", "launcher.sh", "fab (kill -0 on the head)"),
    _run(rd.MPIRUN_PID, "pid on the head node", "launcher.sh", "fab stop --force"),
    _run(rd.TRAIN_LOG, "text, appended", "mpirun, launcher.sh, spotwatch", "fab logs/fetch, launcher.sh"),
    _run(rd.LAUNCHER_LOG, "text", "the launcher's own output", "people"),
    _run(rd.PROBE_SH, "one line: python -m cluster_node.probe", "fab train (upload)", "launcher.sh"),
    _run(rd.LAUNCHER_SH, "bash: the launcher", "fab train (upload)", "setsid on the head"),
    _run(rd.SUPERVISE_PY, "Python: restart decisions", "fab train (upload)", "launcher.sh"),
    _run(rd.HEALTH_PY, "Python: probe verdicts", "fab train (upload)", "supervise.py"),
    _run(
        f"{rd.RANKS}/{rd.RANK_BEAT}", "`STEP PID HOST` (RankBeat); mtime", "train.callbacks (every rank)", _SUPERVISOR
    ),
    _run(
        f"{rd.STACKS}/{rd.RANK_STACK}",
        "faulthandler stacks on SIGUSR2",
        "train.callbacks (every rank)",
        "supervise.py, people",
    ),
    _run(f"{rd.STACKS}/{rd.HOST_STATES}", "`PID STATE` lines", "launcher.sh (hang)", "supervise.py"),
    _run(f"{rd.STACKS}/{rd.PY_SPY}", "py-spy dump", "launcher.sh (hang)", "people"),
    _run(rd.HANG_STACKS, "the attempt's stacks/ after a hang", "launcher.sh (mv)", "people"),
    _run(f"{rd.PROBES}/HOST", "probe output, JSON on the last line", "launcher.sh", "supervise.py plan"),
    _run(
        f"{rd.CHECKPOINTS}/{rd.CHECKPOINT}",
        "torch state",
        "train.checkpoint (rank 0)",
        "trainer, supervise.py, fab fetch",
    ),
    _run(f"{rd.CHECKPOINTS}/{rd.BEST_CHECKPOINT}", "torch state", "train.checkpoint (rank 0)", "fab fetch"),
    _run(rd.TENSORBOARD, "TensorBoard events", "trainer (rank 0)", "fab tensorboard"),
    _run(rd.EVAL, "eval texts", "trainer (rank 0)", "fab fetch"),
    _run(rd.REPORT_MD, "Markdown", "fab report", "fab fetch"),
    _run(rd.PREDICTIONS, "JSON list: predicted vs measured step", "fab report --verify", "fab report"),
    _run(rd.BREAKDOWN_PNG, "PNG", "fab report", "fab fetch"),
    _run(rd.SCALING_PNG, "PNG", "fab report", "fab fetch"),
    _run(rd.FETCHED, "empty marker", "fab fetch", "fab local.down"),
    _at("runs", rd.ACTIVE, "the head's run path", "fab train; removed by launcher.sh", "fab, autostop, spotwatch"),
    _at("runs", rd.CHECK_RUN, "fab check's run directory", "fab check", "fab check"),
    _at("runs", f"{rd.SCALE_DIR}/{rd.SCALE_JSON}", "JSON", "fab scale", "fab scale"),
    _at("runs", f"{rd.SCALE_DIR}/{rd.SCALE_MD}", "Markdown", "fab scale", "people"),
    _at("cluster", rd.SSH_DIR, "the cluster's SSH identity", "cluster-identity.sh", "entrypoint.sh, mpirun, launcher"),
    _at("cluster", rd.SSH_LOCK, "flock", "cluster-identity.sh", "cluster-identity.sh"),
    _at("cluster", f"{rd.READY_DIR}/{rd.NODE_MARK}", "empty marker", "node-bootstrap.sh", "node_status (fab status)"),
    _at("cluster", f"{rd.HEARTBEAT_DIR}/{rd.NODE_JSON}", "JSON NodeHeartbeat", "autostop", "autostop (the others)"),
    _at("cluster", f"{rd.AUTOSTOP_DIR}/{rd.NODE_JSON}", "JSON idle_state.IdleState", "autostop", "autostop"),
    _at("cluster", rd.AUTOSTOP_LOG, "text", "autostop", "people"),
    _at("cluster", rd.AUTOSTOP_NODE_LOG, "text", "entrypoint.sh", "people"),
    _at("cluster", rd.SPOT_NODE_LOG, "text", "entrypoint.sh", "people"),
    _at("cluster", f"{rd.BUSY_DIR}/{rd.BUSY_MARKER}", "JSON BusyMarker", "prepare.py", "autostop"),
    _at("cluster", rd.LINK_JSON, "JSON (linkcheck.summary)", "fab check", "fab report, fab check"),
    _at("cluster", rd.TRANSPORT_JSON, "JSON (health.transport_verdict)", "fab check", "fab train"),
    _at("cluster", rd.HEALTH_PROBE_FILE, "the probe's write test", "cluster_node.probe", "cluster_node.probe"),
)

_WHERE = {"run": f"DATA/{rd.RUNS}/NAME/", "runs": f"DATA/{rd.RUNS}/", "cluster": f"DATA/{rd.CLUSTER}/"}


def protocol_table(files: Iterable[ProtocolFile] = FILES) -> str:
    """The protocol as a Markdown table, for docs/architecture.md."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| name | writer | readers | format |", "|---|---|---|---|"]
    for f in files:
        name = f"`{_WHERE[f.where]}{f.path}`"
        rows.append(f"| {cell(name)} | {cell(f.writers)} | {cell(f.readers)} | {cell(f.format)} |")
    return "\n".join(rows) + "\n"
