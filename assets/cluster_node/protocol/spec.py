"""The run spec: everything one attempt of a run needs, written once by `fab train` (spec.json in the run
directory) and once more by the supervisor for every restart (attempt N+1 on the healthy hosts; the earlier
ones stay in specs/attempt-N.json for the record). `RunSpec.argv()` is the one builder of the mpirun line:
`fab train`, `fab check` and every restart go through it. Stdlib only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from cluster_node.protocol import rundir

BATCH_FLAGS = ("--batch-per-gpu", "--grad-accum", "--keep-global-batch")


def sized_by_tokens(config: Mapping[str, Any]) -> bool:
    """A translation run (config.json) whose micro-batches a --max-tokens budget sizes: its batch_per_gpu sizes
    none, so a rebalance keeps it and moves only the accumulation (ranks x accumulation: what a step takes)."""
    text = not str(config.get("recipe", "")).startswith("resnet")
    return text and config.get("batching") == "tokens" and bool(config.get("max_tokens"))


def trained_world(config: Mapping[str, Any], spec: Optional["RunSpec"]) -> Optional[int]:
    """The ranks the run's config.json was trained on: the trainer's own record, else (a run saved before it kept
    one) its spec's hosts x slots, which a launch that failed before its first step may have rewritten."""
    if config.get("world_size"):
        return int(config["world_size"])
    return len(spec.hosts) * spec.slots if spec is not None else None


def trained_global_batch(config: Mapping[str, Any], spec: Optional["RunSpec"]) -> Optional[int]:
    """Objects a step of the run took (config.json's batch x accumulation x trained_world); None when unknown."""
    world = trained_world(config, spec)
    return int(config["batch_per_gpu"]) * int(config["grad_accum"]) * world if world else None


@dataclass(frozen=True)
class Batch:
    """A restart's batch split: the same global batch over fewer (or more) ranks."""

    batch_per_gpu: int
    grad_accum: int
    keep_global_batch: int

    def flags(self) -> list[str]:
        values = (self.batch_per_gpu, self.grad_accum, self.keep_global_batch)
        return [part for flag, value in zip(BATCH_FLAGS, values) for part in (flag, str(value))]


@dataclass(frozen=True)
class Limits:
    """The supervisor's clocks (seconds) and the restart budget."""

    poll: float = 5.0
    stall: float = 600.0  # no progress for this long: a hang
    start: float = 900.0  # the first step must come within this (mpirun start-up, data load)
    hang_floor: float = 60.0  # a hang window is at least this (checkpoints and evals take longer than a step)
    hang_factor: float = 20.0  # ... and HANG_FACTOR x the measured step time
    unreachable: int = 2  # missed ssh checks in a row before a node counts as lost
    max_restarts: int = 0
    min_nodes: int = 1
    cleanup: float = 600.0  # retry the cleanup of unreached nodes this long after the end
    spot_margin: float = 30.0  # on a notice for the supervisor's node: TERM mpirun this long before the action


@dataclass(frozen=True)
class ThenStop:
    """`fab train --then-stop`: the command that stops the cluster and the environment it needs (the
    supervisor runs in an SSH session without AWS variables)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Budget:
    """`fab train --budget-usd`: the spend that ends the run gracefully, priced as `fab cost` projects it
    (nodes x $/node-hour x time, EFS I/O), with the prices fab train found. EFS I/O: the bytes CloudWatch
    counts for the file system since the run's start (efsio.py); without it, the launch-time $/hour."""

    usd: float
    usd_per_node_hour: float  # the Spot price in effect on a Spot cluster
    io_usd_per_hour: float = 0.0  # EFS I/O's rate in the hour before fab train: the fallback
    source: str = ""  # where the prices come from, one line
    nodes: int = 0  # the nodes that bill: the whole cluster the run started on (0: a spec from an older fab)
    spent: float = 0.0  # what the run's earlier segments spent (budget.json), carried over on resume
    file_system_id: str = ""  # on AWS: the file system whose metrics the meter sums ("" elsewhere)
    region: str = ""
    io_read_usd_per_gb: float = 0.0  # Elastic throughput's prices (metadata bills as reads and writes)
    io_write_usd_per_gb: float = 0.0
    # The previous segment's last minutes CloudWatch had not published when it ended (budget.json's io_to to
    # its time): asked once by this segment's meter, so no EFS I/O falls between segments. () for none.
    io_tail: tuple[float, ...] = ()
    # On AWS: the cluster's instance ids, whose state EC2 reports at every meter reading ("": the notices rule).
    instance_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunSpec:
    run: str  # the run directory
    attempt: int
    supervisor_host: str  # the private address of the node the supervisor runs on
    hosts: tuple[str, ...]  # this attempt's nodes, rank order
    pool: tuple[str, ...]  # the nodes the run may use: the first attempt's (a restart probes them all)
    slots: int
    env: Mapping[str, str]  # -x exports for every rank
    process_env: Mapping[str, str]  # mpirun's own environment
    mpirun_options: tuple[str, ...]  # between the placement and the exports
    program: tuple[str, ...]
    ssh_config: str
    active_file: str
    python: str
    root: str = ""  # the cluster_node package's root on the nodes (PYTHONPATH for the hang dump)
    resume: tuple[str, ...] = ()  # the `fab train` command that resumes this run (a Spot end prints it)
    limits: Limits = field(default_factory=Limits)
    batch: Optional[Batch] = None
    then_stop: Optional[ThenStop] = None
    budget: Optional[Budget] = None
    names: Mapping[str, str] = field(default_factory=dict)  # host -> the inventory's name (node2), for people

    def name(self, host: str) -> str:
        return self.names.get(host, host)

    def names_of(self, hosts, sep: str = ",") -> str:
        return sep.join(self.name(host) for host in hosts)

    def summary(self) -> str:
        """The launch in one line for people (train.log); argv() is the whole line."""
        ranks = len(self.hosts) * self.slots
        return f"mpirun: {ranks} ranks on {self.names_of(self.hosts)} (spec attempt {self.attempt})"

    def argv(self) -> list[str]:
        """mpirun -np RANKS -H host:slots,... OPTIONS -x K=V ... PROGRAM [batch flags]."""
        argv = ["mpirun", "--allow-run-as-root", "-np", str(len(self.hosts) * self.slots)]
        argv += ["-H", ",".join(f"{host}:{self.slots}" for host in self.hosts), *self.mpirun_options]
        for key, value in self.env.items():
            argv += ["-x", f"{key}={value}"]
        return argv + self.program_argv()

    def program_argv(self) -> list[str]:
        """The program with the restart's batch flags in place of any it was given."""
        program = list(self.program)
        if self.batch is None:
            return program
        for flag in BATCH_FLAGS:
            while flag in program:
                index = program.index(flag)
                del program[index : index + 2]
        return program + self.batch.flags()

    def restart(self, hosts: tuple[str, ...], batch: Batch) -> RunSpec:
        """Attempt N+1 on `hosts`: the rendezvous on the first of them, the rebalanced batch."""
        env = {**self.env, "MASTER_ADDR": hosts[0]}
        return dataclasses.replace(self, attempt=self.attempt + 1, hosts=hosts, env=env, batch=batch)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> RunSpec:
        try:
            fields = dict(value)
            for name in ("hosts", "pool", "mpirun_options", "program"):
                fields[name] = tuple(fields[name])
            fields["resume"] = tuple(fields.get("resume") or ())
            fields["limits"] = Limits(**fields.get("limits") or {})
            fields["batch"] = Batch(**fields["batch"]) if fields.get("batch") else None
            fields["budget"] = _budget(fields["budget"]) if fields.get("budget") else None
            stop = fields.get("then_stop")
            fields["then_stop"] = ThenStop(tuple(stop["argv"]), stop.get("env") or {}) if stop else None
            return cls(**fields)
        except (KeyError, TypeError) as error:
            raise rundir.RecordError(f"RunSpec: {error}") from None


def write(run: Path, spec: RunSpec) -> None:
    """spec.json (what the supervisor launches next) and specs/attempt-N.json (the record)."""
    (run / rundir.SPECS).mkdir(exist_ok=True)
    rundir.write_json(rundir.spec_record(run, spec.attempt), spec.to_json(), indent=1)
    rundir.write_json(run / rundir.SPEC, spec.to_json(), indent=1)


def _budget(fields: dict) -> Budget:
    lists = {name: tuple(fields.get(name) or ()) for name in ("io_tail", "instance_ids")}  # JSON gives lists
    return Budget(**{**fields, **lists})


def read(run: Path) -> RunSpec:
    return RunSpec.from_json(rundir.read_json(run / rundir.SPEC) or {})
