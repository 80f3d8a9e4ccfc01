"""`fab train` on the laptop, before anything starts: a run that exists resumes with its saved settings
(config.json: what it trains; spec.json: how it was supervised), and every flag meant for the trainer (fab's
own and `--extra`) goes through the trainer's own parser and checks, so a bad or conflicting one is one line
here rather than argparse's usage once per rank and a run marked failed."""

from __future__ import annotations

import dataclasses
import difflib
import shlex
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from fabric import Connection

from cluster_node.protocol import rundir
from cluster_node.protocol.spec import BATCH_FLAGS, Batch, RunSpec, sized_by_tokens, trained_global_batch, trained_world
from cluster_node.supervisor.budget import Spend
from cluster_node.supervisor.restart_plan import rebalance
from clusterops.inventory import Inventory
from clusterops.nodes import records as noderecords
from clusterops.nodes import remote
from clusterops.run import launch

KEEP = "a resumed run keeps its settings; start a new --run to change them"
# fab train's flags that only say how the run is supervised, and where spec.json keeps each one.
LIMITS: dict[str, Callable[[RunSpec], Any]] = {
    "max_restarts": lambda spec: spec.limits.max_restarts,
    "min_nodes": lambda spec: spec.limits.min_nodes,
    "hang_seconds": lambda spec: spec.limits.hang_floor,
    "stall_minutes": lambda spec: spec.limits.stall / 60,
    "start_minutes": lambda spec: spec.limits.start / 60,
    "master_port": lambda spec: int(spec.env["MASTER_PORT"]),
}


@dataclasses.dataclass(frozen=True)
class Saved:
    """A run's saved settings, read from the head node: config.json (the trainer's), spec.json, budget.json
    (--budget-usd's limit and the spend so far) and the step of the newest checkpoint (where it resumes)."""

    config: dict[str, Any]
    spec: Optional[RunSpec]  # None: none saved, or one an older fab wrote that is not today's RunSpec
    budget: Optional[Spend] = None
    step: Optional[int] = None


def saved(connection: Connection, inventory: Inventory, run: str) -> Optional[Saved]:
    """The run's saved settings; None for a new run (no config.json: it never reached its first step)."""
    rdir = launch.run_dir(inventory, run)
    found = noderecords.read(connection, inventory, rdir, rundir.CONFIG, rundir.SPEC, rundir.BUDGET, lenient=LENIENT)
    if not found.config:
        return None
    listing = remote.sh(connection, f"ls -1 {shlex.quote(rdir)}/{rundir.CHECKPOINTS} 2>/dev/null || true")
    steps = [rundir.checkpoint_step(Path(name)) for name in listing.split()]
    return Saved(found.config, found.spec, found.spend, max((s for s in steps if s is not None), default=None))


# A spec.json an older fab wrote may not be today's RunSpec: the resume then takes this launch's limits.
LENIENT = (rundir.SPEC,)


def resumed(request: launch.TrainRequest, given: set[str], run: Saved, inventory: Inventory) -> launch.TrainRequest:
    """The request that resumes the run: its recipe and data, and the limits it had unless given again.
    A --recipe or --dataset other than the run's is refused (the trainer's own checks take the rest)."""
    name, recipe, data = request.run_name, run.config.get("recipe"), run.config.get("data")
    if "recipe" in given and request.recipe != recipe:
        raise launch.LaunchError(f"--recipe {request.recipe} differs from run {name}'s {recipe}: {KEEP}")
    if request.dataset is not None and launch.data_path(inventory, request.dataset) != data:
        raise launch.LaunchError(f"--dataset {request.dataset} differs from run {name}'s data {data}: {KEEP}")
    if request.data is not None and request.data.rstrip("/") != data:
        raise launch.LaunchError(f"--data {request.data} differs from run {name}'s data {data}: {KEEP}")
    kept: dict[str, Any] = {"recipe": recipe, "data": data}
    if request.budget_usd is None and run.budget and run.budget.usd:
        kept["budget_usd"] = run.budget.usd  # a new --budget-usd replaces the limit (never the spend)
    for field, read in LIMITS.items():
        if field not in given and run.spec is not None:
            try:
                kept[field] = read(run.spec)
            except (KeyError, ValueError):
                continue  # no MASTER_PORT in a spec from an older fab: this launch's value
    extra = tuple(request.extra_args)
    if (run.config.get("vision") or {}).get("synthetic") and "--synthetic" not in extra:
        extra += ("--synthetic",)  # the run's data is generated: no data set to look for
    return dataclasses.replace(request, extra_args=extra, **kept)


def keep_global_batch(request: launch.TrainRequest, run: Saved, ranks: int, gpus_per_node: int, nodes: int) -> tuple:
    """(request, words): a saved run launched on another number of ranks than it last trained on keeps its global
    batch, split over `ranks` as the supervisor splits it after a lost node (restart_plan.rebalance; a --max-tokens
    run's micro-batch stays, its accumulation moves): its learning rate, sample stream and steps left count it.
    Refused in one line, naming the node counts of this cluster (`nodes`) that keep it, when it does not split; left
    to the trainer's checks when the batch is given (fab's --batch-per-gpu, or --extra)."""
    given = request.batch_per_gpu is not None or any(a.split("=")[0] in BATCH_FLAGS for a in request.extra_args)
    before = trained_world(run.config, run.spec)
    if before is None or given or ranks == before:
        return request, ""
    per_rank, fixed = int(run.config["batch_per_gpu"]), sized_by_tokens(run.config)
    kept = trained_global_batch(run.config, run.spec) or 0
    split = rebalance(kept, ranks, per_rank, fixed)
    if split is None:
        fits = [n for n in range(1, nodes + 1) if rebalance(kept, n * gpus_per_node, per_rank, fixed)]
        raise launch.LaunchError(
            f"run {request.run_name} trained at a global batch of {kept} on {before} ranks, which does not split "
            f"evenly over {ranks}{' with its micro-batch (--max-tokens)' if fixed else ''}: resume it with "
            f"--nodes {' or '.join(map(str, fits)) or 'N'}, or start a new --run"
        )
    flags = Batch(*split, kept).flags()
    words = f"its global batch {kept} kept on {ranks} ranks instead of {before} ({shlex.join(flags)})"
    return dataclasses.replace(request, extra_args=(*request.extra_args, *flags)), words


def _refuse(request: launch.TrainRequest):
    def error(message: str) -> NoReturn:
        extra = shlex.join(request.extra_args)
        raise launch.LaunchError(f"invalid --extra {extra!r}: the trainer refuses it: {message}")

    return error


def check_trainer(inventory: Inventory, request: launch.TrainRequest, run: Optional[Saved], nodes: int):
    """The trainer's argument line parsed by the trainer's parser, then its configuration checks (a new
    run's) or its resume checks (a saved run's: train.config.resume_config), on the laptop. Returns the
    run's train.config.TrainConfig as the trainer will see it on `nodes` of this cluster's ranks per node."""
    from train.config import ConfigError, build_parser, config_from_args, resume_config

    parser = build_parser("python -m train.train")
    parser.error = _refuse(request)  # type: ignore[method-assign]  # argparse prints usage and exits
    args = parser.parse_args(launch.trainer_args(inventory, request))
    try:
        world = nodes * inventory.gpus_per_node
        config = resume_config(run.config, args)[0] if run else config_from_args(args, world)
    except ConfigError as error:
        raise launch.LaunchError(f"{error}" + (f" (run {request.run_name})" if run else "")) from None
    except (KeyError, TypeError) as error:  # a config.json this trainer cannot read
        raise launch.LaunchError(f"run {request.run_name}'s {rundir.CONFIG} is not this trainer's: {error}") from None
    return config


def run_names(connection: Connection, inventory: Inventory) -> list[str]:
    """The runs on /data, by name."""
    root = shlex.quote(f"{inventory.data_dir}/{rundir.RUNS}")
    return remote.sh(connection, f"ls -1 {root} 2>/dev/null || true").split()


def free_name(base: str, taken: list[str]) -> str:
    """BASE-2, BASE-3, ...: the first name no run has."""
    return next(f"{base}-{n}" for n in range(2, len(taken) + 3) if f"{base}-{n}" not in taken)


def refuse_finished(request: launch.TrainRequest, run: Saved, max_steps: int, taken: list[str]) -> None:
    """A run whose newest checkpoint is at its max steps has nothing to train: a launch would only rewrite
    its results (the trainer's summary of zero steps). One line saying how to train more or start anew."""
    if run.step is None or run.step < max_steps:
        return
    name = request.run_name
    raise launch.LaunchError(
        f"run {name} already finished at step {run.step} (max steps {max_steps}): nothing to train, its results "
        f"stay. Train it further with `fab train --run {name} --steps {run.step + max(run.step // 2, 1)}`, or "
        f"start a new run with `fab train --recipe {run.config.get('recipe', request.recipe)} "
        f"--run {free_name(name, taken)}`"
    )


def new_run_line(request: launch.TrainRequest) -> str:
    """'started NAME, a new run: recipe R, data set D' (a typo in --run started one silently)."""
    dataset = request.dataset or launch.default_dataset(request.recipe)
    return f"started {request.run_name}, a new run: recipe {request.recipe}, data set {dataset},"


def close_run(name: str, taken: list[str]) -> str:
    """The existing run whose name is close to a new run's, which `--run` would have resumed; "" if none."""
    close = difflib.get_close_matches(name, [t for t in taken if t != name], n=1, cutoff=0.75)
    return f"{name} is a new run; {close[0]} exists: `fab train --run {close[0]}` resumes that one" if close else ""
