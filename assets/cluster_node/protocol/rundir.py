"""The run directory (DATA/runs/NAME) written down once: every file name, a frozen record per JSON file,
one atomic read/write (DATA/.cluster's names are in clusterdir.py). Stdlib only: the trainer, supervisor
and watchers on the nodes and fab on the laptop share it. protocol.py tabulates the files (writer,
readers, format) for the docs. A record's from_json accepts what today's writer writes and keeps unknown
keys in `extra` (to_json writes them back). Writes: temp file beside the target, fsync, os.replace.
Reads: a missing or partly written file gives the default; a list entry that does not parse is skipped."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional, TypeVar, Union

from cluster_node.protocol.clusterdir import BUSY_MARKER, NODE_JSON

# ---------------------------------------------------------------- names: DATA/runs/NAME/...

RUNS = "runs"  # DATA/runs: one directory per run
RUN_STATUS = "run-status.json"
PROGRESS = "progress.json"
SUMMARY = "summary.json"
CONFIG = "config.json"
RESTARTS = "restarts.json"
HANGS = "hangs.json"
INTERRUPTIONS = "interruptions.json"
INTERRUPTIONS_LOCK = ".interruptions.lock"
SPEC = "spec.json"  # the next (or current) attempt's RunSpec (cluster_node.protocol.spec)
SPECS = "specs"  # specs/attempt-N.json: every attempt's spec, for the record
SPEC_ATTEMPT = "attempt-{n}.json"
STOP = "STOP"
STOP_TAKEN = "STOP.taken"  # a STOP the supervisor took aside during a restart (loop.took_a_workers_notice)
FORCED = "FORCED"
LAUNCHER_PID = "launcher.pid"
MPIRUN_PID = "mpirun.pid"
TRAIN_LOG = "train.log"
LAUNCHER_LOG = "launcher.log"
PROBE_SH = "probe.sh"
RANKS = "ranks"
RANK_BEAT = "rank{rank}"  # ranks/rankN
STACKS = "stacks"
RANK_STACK = "rank{rank}.txt"  # stacks/rankN.txt
HOST_STATES = "states.{host}"  # stacks/states.HOST
PY_SPY = "py-spy.{host}.{pid}.txt"  # stacks/py-spy.HOST.PID.txt
HANG_STACKS = "hang-stacks-{n}"
PROBES = "probes"  # probes/HOST
CHECKPOINTS = "checkpoints"
CHECKPOINT = "step_{step:08d}.pt"
CHECKPOINT_GLOB = "step_*.pt"  # every step checkpoint, best.pt excluded
BEST_CHECKPOINT = "best.pt"
TENSORBOARD = "tensorboard"
EVAL = "eval"
EVAL_TEXT = "step_{step:08d}.{kind}.txt"  # eval/: a KIND (samples, translations) of the eval at STEP
REPORT_MD = "report.md"
PREDICTIONS = "predictions.json"  # fab report --verify: predicted vs measured pairs
PHASES = "phases.jsonl"  # protocol.phases.Phase lines: where the wall-clock went (supervisor.goodput)
GOODPUT_PNG = "goodput.png"
BREAKDOWN_PNG = "breakdown.png"
SCALING_PNG = "scaling.png"
FETCHED = ".fetched"
SEGMENTS = "segments.json"  # one entry per supervisor (a `fab train` launch or resume) that ended
BUDGET = "budget.json"  # --budget-usd's limit and the spend so far (cluster_node.supervisor.budget.Spend)
# What `fab fetch` takes besides a checkpoint and the last evals (lifecycle._download_run, localdata).

# ---------------------------------------------------------------- names: DATA/runs/ beside the runs

ACTIVE = ".active"  # runs/.active: the head's run path
CHECK_RUN = ".check"  # runs/.check: fab check's all-reduce run
SCALE_DIR = "scale-{recipe}"  # runs/scale-RECIPE
SCALE_JSON = "scale.json"
SCALE_MD = "scale.md"
# What `fab fetch` brings home besides a checkpoint and the last evals (a scale series' files too).
FETCHED_FILES: tuple[str, ...] = (CONFIG, SUMMARY, TRAIN_LOG, RUN_STATUS, REPORT_MD, BREAKDOWN_PNG, GOODPUT_PNG)
FETCHED_FILES += (SCALING_PNG, SCALE_JSON, SCALE_MD)


class RunState(str, Enum):
    """run-status.json's `state`, spelled once for every writer and reader. A str: the JSON holds the
    value, and a state compares equal to its value."""

    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"  # resumable: `fab train --run NAME`
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


STATES = tuple(state.value for state in RunState)


class EndKind(str, Enum):
    """Why an attempt or the run ended: restarts.json's and run-status.json's `kind`, phases.jsonl's detect
    `kind`. A str, as RunState."""

    DIED = "died"  # mpirun exited non-zero: a rank died
    HANG = "hang"  # no rank finished a step within the hang window, or progress.json stalled
    UNREACHABLE = "unreachable"  # a node stopped answering ssh
    START = "start"  # no first step within limits.start
    SPOT = "spot"  # a Spot notice (another node: a restart; the supervisor's own: the end, resumable)
    FORCED = "forced"  # fab stop --force
    BUDGET = "budget"  # --budget-usd reached

    def __str__(self) -> str:
        return self.value


KINDS = tuple(kind.value for kind in EndKind)


class EndedBy(str, Enum):
    """What ended the training program (Progress's end record and Summary: `ended_by`; `ended` keeps the
    words the trainer logs)."""

    STEPS = "steps"  # max_steps reached
    TARGET = "target"  # the target metric reached
    STOP = "stop"  # a STOP (fab stop, a Spot notice, the budget): a checkpoint, resumable

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, ended_by: Optional[str], ended: Optional[str]) -> Optional[EndedBy]:
        """A record's `ended_by`; for a record written before it (`ended`'s words only), from the words those
        trainers wrote; None when the record says neither (not an end record) or a value this reader lacks."""
        if ended_by is not None:
            return next((by for by in cls if by.value == ended_by), None)
        legacy = {"max_steps": cls.STEPS, "stop requested": cls.STOP, "target ": cls.TARGET}
        return next((by for words, by in legacy.items() if (ended or "").startswith(words)), None)


class ThenStopState(str, Enum):
    """run-status.json's `then_stop`: --then-stop's request is going out, went out, or failed."""

    STOPPING = "stopping"
    SENT = "sent"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


LAUNCH_LOCK = "/run/gpu-cluster-launch.lock"  # the head node's launch claim (cluster_node.programs.start says why)
# Each node's in-memory snapshot of a run (train.snapshot): SNAPSHOT_ROOT/NAME/SNAPSHOT, outside /data and
# the ranks, so it outlives them; $SNAPSHOT_DIR_ENV replaces the root (emulated nodes share one machine).
# Named by its step, as a checkpoint: the probe reports what a node holds without loading it.
SNAPSHOT_ROOT = "/dev/shm/gpu-cluster"
SNAPSHOT_DIR_ENV = "GPU_CLUSTER_SNAPSHOT_DIR"
SNAPSHOT = "snapshot_{step:08d}.pt"
SNAPSHOT_GLOB = "snapshot_*.pt"


def snapshot_root(env: Optional[Mapping[str, str]] = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(SNAPSHOT_DIR_ENV) or SNAPSHOT_ROOT)


URGENT_STOP_WORD = "now"  # a STOP whose first word is this checkpoints without the eval (spotwatch)


def run_dir(data_dir: Union[str, os.PathLike], name: str) -> Path:
    return Path(data_dir) / RUNS / name


def active_file(data_dir: Union[str, os.PathLike]) -> Path:
    return Path(data_dir) / RUNS / ACTIVE


def rank_beat(run: Path, rank: int) -> Path:
    return run / RANKS / RANK_BEAT.format(rank=rank)


def spec_record(run: Path, attempt: int) -> Path:
    return run / SPECS / SPEC_ATTEMPT.format(n=attempt)


def checkpoint(run: Path, step: int) -> Path:
    return run / CHECKPOINTS / CHECKPOINT.format(step=step)


def checkpoint_step(path: Path, pattern: str = CHECKPOINT) -> Optional[int]:
    """The step of a CHECKPOINT file (a SNAPSHOT with pattern=SNAPSHOT); None for any other name (best.pt,
    a temp file)."""
    stem, dot, ext = path.name.partition(".")
    prefix = pattern.split("{")[0]
    digits = stem[len(prefix) :]
    ok = stem.startswith(prefix) and digits.isdigit() and dot + ext == ".pt"
    return int(digits) if ok else None


def snapshot_step(path: Path) -> Optional[int]:
    return checkpoint_step(path, SNAPSHOT)


# ---------------------------------------------------------------- atomic read/write


def write_bytes(path: Path, data: bytes) -> None:
    """Write into a temp file beside `path` (`.NAME.tmp.PID`, as data.atomic_write_bytes names it), fsync,
    rename: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, value: Any, indent: Optional[int] = None) -> None:
    write_bytes(path, json.dumps(value, indent=indent).encode())


def read_json(path: Path, default: Any = None) -> Any:
    """The file's JSON; `default` when it is missing, empty or not (yet, or no longer) whole JSON."""
    try:
        text = path.read_text()
        return json.loads(text) if text.strip() else default
    except (OSError, ValueError):
        return default


# ---------------------------------------------------------------- records

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A JSON value that is not the record: a required key missing, or a value of the wrong type."""


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "node": (int, str)}
_TYPES |= {"list": (list, tuple), "dict": (dict,)}


def _key(kind: str, required: bool = False, null: bool = False, default: Any = None) -> Any:
    """A record field: its JSON type, whether from_json needs the key, whether None is written as null
    (else a None field is left out, as the writers leave the key out)."""
    return field(default=default, metadata={"kind": kind, "required": required, "null": null})


def _check(name: str, kind: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, _TYPES[kind]):
        raise RecordError(f"{name}: {kind} expected, got {value!r}")
    checked: Any = value
    return tuple(checked) if kind == "list" else float(checked) if kind == "float" else checked


@dataclass(frozen=True)
class Record:
    """A JSON object with named keys; keys it does not know are kept in `extra`."""

    extra: Mapping[str, Any] = field(default_factory=dict, compare=True, kw_only=True)
    FILE: ClassVar[str] = ""

    @classmethod
    def _keys(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_json(cls: type[R], value: Any) -> R:
        if not isinstance(value, dict):
            raise RecordError(f"{cls.__name__}: a JSON object expected, got {type(value).__name__}")
        keys = cls._keys()
        missing = [f.name for f in keys if f.metadata["required"] and f.name not in value]
        if missing:
            raise RecordError(f"{cls.__name__}: missing {', '.join(missing)}")
        known = {f.name for f in keys}
        values = {f.name: _check(f.name, f.metadata["kind"], value[f.name]) for f in keys if f.name in value}
        return cls(**values, extra={k: v for k, v in value.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in self._keys():
            value = getattr(self, f.name)
            if value is not None or f.metadata["null"] or f.metadata["required"]:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return {**out, **self.extra}


@dataclass(frozen=True)
class RunStatus(Record):
    """run-status.json: the supervisor's verdict on the run (cluster_node.supervisor.loop)."""

    FILE: ClassVar[str] = RUN_STATUS
    state: str = _key("str", required=True)  # a RunState
    exit_code: Optional[int] = _key("int", required=True, null=True)
    reason: str = _key("str", required=True)
    time: str = _key("str", required=True)  # ISO UTC, whole seconds
    head: str = _key("str", required=True)  # hostname of the node that wrote it
    live: Optional[str] = _key("str")  # the supervisor's State while `state` is running
    kind: Optional[str] = _key("str")  # why it ended: an EndKind (absent on a clean end)
    resume: Optional[str] = _key("str")  # the command that resumes a run a Spot notice ended
    then_stop: Optional[str] = _key("str")  # --then-stop: a ThenStopState


@dataclass(frozen=True)
class Progress(Record):
    """progress.json: rank 0's latest logged step (train.callbacks.ProgressFile), and once more at the end."""

    FILE: ClassVar[str] = PROGRESS
    step: int = _key("int", required=True)
    max_steps: Optional[int] = _key("int")
    time: Optional[float] = _key("float")  # epoch s
    world_size: Optional[int] = _key("int")
    loss: Optional[float] = _key("float", null=True)  # None at the end record
    avg_step_time_s: Optional[float] = _key("float")
    breakdown: Optional[Mapping[str, Any]] = _key("dict")
    elapsed_s: Optional[float] = _key("float")
    eta_s: Optional[float] = _key("float")
    ended: Optional[str] = _key("str")  # only in the end record: why the run ended, in words
    ended_by: Optional[str] = _key("str")  # only in the end record: an EndedBy

    @property
    def end(self) -> Optional[EndedBy]:
        """What ended the trainer; None before its end record."""
        return EndedBy.of(self.ended_by, self.ended)


@dataclass(frozen=True)
class Summary(Record):
    """summary.json: the run's result (trainer._summary). The eval metrics (`bleu`, `top1`, `best_bleu`,
    ...) depend on the task: they are in `extra` (`metrics`)."""

    FILE: ClassVar[str] = SUMMARY
    recipe: str = _key("str", required=True)
    steps: int = _key("int", required=True)
    world_size: Optional[int] = _key("int")
    global_batch: Optional[int] = _key("int")
    objects: Optional[str] = _key("str")
    avg_step_time_s: Optional[float] = _key("float")
    objects_per_s: Optional[float] = _key("float")
    checkpoint_mb: Optional[float] = _key("float", null=True)
    precision: Optional[str] = _key("str")
    grad_compression: Optional[str] = _key("str")
    resumed_from: Optional[str] = _key("str", null=True)
    ended: Optional[str] = _key("str")  # in words, as logged
    ended_by: Optional[str] = _key("str")  # an EndedBy (absent in a summary from before it: see `end`)
    wall_time_s: Optional[float] = _key("float")
    breakdown: Optional[Mapping[str, Any]] = _key("dict")
    calibration: Optional[Mapping[str, Any]] = _key("dict", null=True)
    auto_compression: Optional[Mapping[str, Any]] = _key("dict", null=True)
    goodput: Optional[Mapping[str, Any]] = _key(
        "dict"
    )  # the supervisor's, at the end (cluster_node.supervisor.goodput)

    @property
    def metrics(self) -> Mapping[str, Any]:
        return self.extra

    @property
    def end(self) -> Optional[EndedBy]:
        return EndedBy.of(self.ended_by, self.ended)

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation of the steady step (train.perf); None on a CPU (no tensor-core peak)."""
        value = self.extra.get("mfu")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def peak(self) -> tuple[Optional[str], Optional[float]]:
        """(device, its datasheet dense 16-bit TFLOP/s) the MFU is of."""
        peak = self.extra.get("mfu_peak") or {}
        return (peak.get("device"), peak.get("tflops")) if isinstance(peak, dict) else (None, None)

    @property
    def warmup(self) -> Mapping[str, Any]:
        """train.perf.steady_state: settled, note, warmup_steps, warmup_s, steady_steps, steady_step_s; and
        shapes_warmed, shape_warm_s where batch shapes were run once before step 1 (perf.warm_shapes)."""
        value = self.extra.get("warmup")
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Restart(Record):
    """One entry of restarts.json (restart_plan.plan)."""

    FILE: ClassVar[str] = RESTARTS
    time: str = _key("str", required=True)  # ISO UTC
    kind: str = _key("str", required=True)  # an EndKind: died, hang, unreachable, start, spot
    reason: str = _key("str", required=True)
    nodes_before: tuple[str, ...] = _key("list", required=True)
    nodes_after: tuple[str, ...] = _key("list", required=True)
    dropped: Mapping[str, str] = _key("dict", required=True)  # host -> why
    rejoined: tuple[str, ...] = _key("list", required=True)
    resume_step: Optional[int] = _key("int", required=True, null=True)
    global_batch: int = _key("int", required=True)
    batch_per_gpu: int = _key("int", required=True)
    grad_accum: int = _key("int", required=True)
    max_batch_per_gpu: int = _key("int", required=True)
    names: Optional[Mapping[str, str]] = _key("dict")  # host -> the inventory's name (node2), for people
    # Where resume_step's state is (absent in older records: a checkpoint): "checkpoint", or "snapshot" (the
    # nodes' own; with resume_holder: that host's, copied to /data; restart_plan.ResumePoint); the steps
    # finished after it and their stepping time.
    resume_from: Optional[str] = _key("str")
    resume_holder: Optional[str] = _key("str")
    steps_lost: Optional[int] = _key("int")
    lost_s: Optional[float] = _key("float")


@dataclass(frozen=True)
class Hang(Record):
    """One entry of hangs.json (hang.record)."""

    FILE: ClassVar[str] = HANGS
    time: float = _key("float", required=True)  # epoch s (the other records keep ISO times)
    rank: Optional[int] = _key("int", required=True, null=True)  # None: no rank wrote a heartbeat
    evidence: str = _key("str", required=True)


@dataclass(frozen=True)
class Interruption(Record):
    """One entry of interruptions.json (spotwatch.handle): a Spot notice a node's watcher acted on."""

    FILE: ClassVar[str] = INTERRUPTIONS
    node: Union[int, str, None] = _key("node", null=True)  # NODE_RANK
    instance_id: Optional[str] = _key("str", null=True)
    host: Optional[str] = _key("str", null=True)  # the node's private IP, as the hostfile names it
    action: Optional[str] = _key("str")  # stop, terminate
    action_time: Optional[str] = _key("str")  # when EC2 acts, as IMDS says it ("" when unknown)
    step: Optional[int] = _key("int", null=True)  # progress.json's step when noticed
    noticed: str = _key("str", required=True)  # ISO UTC, whole seconds


@dataclass(frozen=True)
class NodeHeartbeat(Record):
    """.cluster/heartbeat/nodeN.json: a node's own reasons to stay up (autostop.share)."""

    FILE: ClassVar[str] = NODE_JSON
    time: float = _key("float", required=True)
    busy: tuple[str, ...] = _key("list", required=True)


@dataclass(frozen=True)
class BusyMarker(Record):
    """.cluster/busy/HOST-PID.json: a long job that is not a run (prepare.py busy_marker)."""

    FILE: ClassVar[str] = BUSY_MARKER
    what: str = _key("str", required=True)
    time: float = _key("float", required=True)


@dataclass(frozen=True)
class RankBeat:
    """ranks/rankN: `STEP PID HOST` of the rank's last finished step (train.callbacks.RankHeartbeat); its mtime is
    the time of that step."""

    step: int
    pid: int
    host: str

    @classmethod
    def from_text(cls, text: str) -> RankBeat:
        try:
            step, pid, host = text.split()[:3]
            return cls(int(step), int(pid), host)
        except ValueError as error:
            raise RecordError(f"rank heartbeat {text[:80]!r}: {error}") from None

    def to_text(self) -> str:
        return f"{self.step} {self.pid} {self.host}\n"


@dataclass(frozen=True)
class Segment(Record):
    """One entry of segments.json: a supervisor's stretch of the run, from its start to its final status."""

    FILE: ClassVar[str] = SEGMENTS
    started: float = _key("float", required=True)  # epoch s
    ended: float = _key("float", required=True)
    state: str = _key("str", required=True)


RECORDS = (RunStatus, Progress, Summary, Restart, Hang, Interruption, NodeHeartbeat, BusyMarker, Segment)


def read_record(path: Path, kind: type[R], default: Optional[R] = None) -> Optional[R]:
    """The file's record; `default` when the file is missing, partly written or not the record."""
    try:
        return kind.from_json(read_json(path))
    except RecordError:
        return default


def write_record(path: Path, record: Record, indent: Optional[int] = None) -> None:
    write_json(path, record.to_json(), indent)


def read_list(path: Path, kind: type[R]) -> tuple[R, ...]:
    """A list file's entries (restarts, hangs, interruptions, segments); () when missing or unreadable; an
    entry that is not the record is skipped (as restart_plan.notices skips it)."""
    value = read_json(path, [])
    out = []
    for entry in value if isinstance(value, list) else []:
        try:
            out.append(kind.from_json(entry))
        except RecordError:
            continue
    return tuple(out)


LIST_INDENT = {RESTARTS: 2, HANGS: 2, INTERRUPTIONS: 1, SEGMENTS: 1}  # as today's writers indent them


def append(path: Path, record: Record, lock: Optional[Path] = None) -> tuple[dict, ...]:
    """Append `record` to the list file and replace it atomically; under `fcntl.lockf` on `lock` when several
    nodes may append at once (interruptions.json). Entries that do not parse are kept. Returns every entry."""
    with contextlib.ExitStack() as stack:
        if lock is not None:
            fcntl.lockf(stack.enter_context(open(lock, "w")), fcntl.LOCK_EX)
        entries = read_json(path, [])
        entries = [*(entries if isinstance(entries, list) else []), record.to_json()]
        write_json(path, entries, LIST_INDENT.get(path.name, 2))
    return tuple(entries)
