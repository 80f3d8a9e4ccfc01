"""`fab report`, `fab runs` and `fab scale`: plain functions that take a connection (or an inventory)."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

from fabric import Connection

from cluster_node.protocol import phases
from cluster_node.protocol import rundir as rd
from cluster_node.supervisor import goodput
from clusterops import terminal
from clusterops.inventory import Inventory
from clusterops.nodes import records as noderecords
from clusterops.nodes import remote
from clusterops.predict import bottleneck, plots, scaling, verify
from clusterops.run import launch, lifecycle
from clusterops.run.linkcheck import link_file

q = shlex.quote
REPORT_FILES = (rd.REPORT_MD, rd.BREAKDOWN_PNG, rd.SCALING_PNG)


# fab scale's defaults: a 1- and a 2-node point, two runs of 30 steps at each (the first 5 not timed)
SCALE_NODE_COUNTS, SCALE_STEPS, SCALE_REPEATS = (1, 2), 30, 2

TC_UNITS = {"bit": 1e-9, "kbit": 1e-6, "mbit": 1e-3, "gbit": 1.0, "tbit": 1e3}


def tc_rate_gbit(rate: Optional[str]) -> Optional[float]:
    """A tc rate ("100mbit", "1gbit") in Gbit/s; None when there is none."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate or "")
    return float(found.group(1)) * TC_UNITS[found.group(2)] if found and found.group(2) in TC_UNITS else None


def rate_text(gbit: float) -> str:
    """A link rate precise enough to check a share against: "38.2 Mbit/s" below 1 Gbit/s, not "0.04"."""
    return f"{gbit:.2f} Gbit/s" if gbit >= 1 else f"{gbit * 1000:.3g} Mbit/s"


def measured_link_gbit(connection: Connection, inventory: Inventory) -> tuple[Optional[float], str]:
    """The link to measure use against: `fab check`'s median pair, else a local cluster's tc cap."""
    link = remote.read_json(connection, link_file(inventory)) or {}
    rate = bottleneck.link_rate(link)
    if rate:
        return rate, f"the measured link ({rate_text(rate)}, {link.get('link_source', 'TCP')}; fab check)"
    cap = tc_rate_gbit(inventory.extra.get("link"))
    if cap:
        return cap, f"the link cap ({inventory.extra['link']}; `fab check` measures the real rate)"
    return None, "no link measurement: run `fab check` for link shares"


def scale_dir(inventory: Inventory, recipe: str) -> str:
    return launch.run_dir(inventory, rd.SCALE_DIR.format(recipe=recipe))


def report_run(connection: Connection, inventory: Inventory, run_dir: str) -> list[str]:
    """The verdict screen for one run; report.md and its PNGs are written into the run directory. A run
    without summary.json (failed, stopped hard, still running) is reported up to its last logged step."""
    summary = noderecords.read(connection, inventory, run_dir, rd.SUMMARY).summary
    heading: list[str] = []
    if summary is None:
        summary, heading = measured_so_far(connection, inventory, run_dir)
    elif not summary.breakdown:
        raise remote.RemoteError(f"{run_dir}/{rd.SUMMARY} has no step breakdown (a run from an older trainer)")
    link = remote.read_json(connection, link_file(inventory))
    scale = remote.read_json(connection, f"{scale_dir(inventory, summary.recipe)}/{rd.SCALE_JSON}")
    scored = verify.lines(_pairs(connection, run_dir))
    account = run_account(connection, inventory, run_dir)
    with tempfile.TemporaryDirectory() as tmp:
        lines, written = bottleneck.write_report(
            Path(run_dir).name, summary, link, tmp, scale, scored, what_ifs=not heading, heading=heading
        )
        lines += ["", *goodput.lines(account)]
        if account is not None:
            written.append(plots.goodput_timeline(account, Path(tmp) / rd.GOODPUT_PNG, Path(run_dir).name))
        for path in written:
            connection.put(str(path), f"{run_dir}/{path.name}")
    return lines + ["", f"written: {', '.join(f'{run_dir}/{p.name}' for p in written)}"]


def run_account(connection: Connection, inventory: Inventory, run_dir: str) -> Optional[goodput.Account]:
    """The goodput account of the run's phases.jsonl (None without one)."""
    return goodput.account(noderecords.read(connection, inventory, run_dir, rd.PHASES).phases)


def measured_so_far(connection: Connection, inventory: Inventory, run_dir: str) -> tuple[rd.Summary, list[str]]:
    """A summary record from the last progress.json of a run that wrote no summary, and the line saying
    so; one line naming the state when the run logged no step at all."""
    found = noderecords.read(connection, inventory, run_dir, rd.RUN_STATUS, rd.PROGRESS, rd.CONFIG)
    status, progress, config = found.status, found.progress, found.config
    state, name = (status and status.state) or "running", Path(run_dir).name
    reason = f" ({status.reason})" if status and status.reason else ""
    if progress is None or not progress.breakdown:
        raise remote.RemoteError(f"run {name} is {state}{reason} and logged no step yet: nothing measured to report")
    world = progress.world_size or 1
    summary = rd.Summary(
        recipe=config.get("recipe", ""),
        steps=progress.step,
        grad_compression=config.get("grad_compression", "none"),
        world_size=world,
        global_batch=(config.get("batch_per_gpu") or 0) * world * (config.get("grad_accum") or 1),
        avg_step_time_s=progress.avg_step_time_s,
        # progress.json's interval breakdown carries no wire bytes: the what-ifs need the run's summary
        breakdown={"wire_bytes": 0.0, "grad_bytes": 0.0, **progress.breakdown},
    )
    line = (
        f"run {name} is {state}{reason}: measured up to step {progress.step}/{progress.max_steps} "
        "(its last log; no summary.json, so no what-ifs)"
    )
    return summary, [line, ""]


def verify_run(
    connection: Connection, inventory: Inventory, run_dir: str, mode: str, request: launch.TrainRequest, code_dir: str
) -> list[str]:
    """`fab report --verify MODE`: the model's step for MODE from this run, a short run that makes
    the change, the pair kept in the run's predictions.json; the lines to print."""
    found = noderecords.read(connection, inventory, run_dir, rd.SUMMARY, rd.CONFIG)
    if found.summary is None or not found.summary.breakdown:
        raise remote.RemoteError(f"{run_dir} has no {rd.SUMMARY} breakdown: the run has not ended")
    summary, config = found.summary, found.config
    slots = inventory.gpus_per_node if inventory.source == "aws" else 1
    try:
        predicted, model, work = verify.predict(summary, measured_link_gbit(connection, inventory)[0], mode, slots)
        one = verify.replaced(request, verify.changes(config, summary, mode, slots), f"{Path(run_dir).name}-verify")
    except verify.VerifyError as error:
        raise remote.RemoteError(str(error)) from None
    one.validate()
    launch.check_nodes(inventory, one)  # nodes=K beyond the cluster: refused before anything is touched
    rdir = launch.run_dir(inventory, one.run_name)
    remote.sh(connection, f"rm -rf {q(rdir)}")
    rdir, _ = lifecycle.start_training(
        connection, inventory, lifecycle.plan_launch(connection, inventory, one, code_dir)
    )
    status = lifecycle.follow_log(connection, inventory, rdir, out=_Discard(), timeout=3600)
    measured = noderecords.read(connection, inventory, rdir, rd.SUMMARY).summary
    if status is None or status.state != rd.RunState.FINISHED or not measured or not measured.avg_step_time_s:
        raise remote.RemoteError(
            f"the {mode} run {status and status.state}: {status and status.reason} (see {rdir}/{rd.TRAIN_LOG})"
        )
    parts = measured.breakdown or {}
    measured_work = {k: parts[f"{k}_s"] for k in verify.WORK} if all(f"{k}_s" in parts for k in verify.WORK) else None
    scored = verify.pair(mode, predicted, model, measured.avg_step_time_s, one.run_name, (work, measured_work))
    pairs = _pairs(connection, run_dir) + [scored]
    remote.write_file(connection, f"{run_dir}/{rd.PREDICTIONS}", json.dumps(pairs, indent=2))
    return [verify.scored_line(scored), *verify.lines(pairs)]


def plan_inputs(connection: Connection, inventory: Inventory, run_dir: str) -> dict:
    """What `fab plan` reads from a run: summary.json, config.json, its eval lines (train.log) and the
    link (measured by `fab check`, else a local cluster's cap)."""
    log = remote.sh(connection, f"grep -a '^eval step ' {q(run_dir + '/' + rd.TRAIN_LOG)} || true")
    found = noderecords.read(connection, inventory, run_dir, rd.SUMMARY, rd.CONFIG)
    return {
        "summary": found.summary,
        "config": dict(found.config),
        "eval_log": log,
        "link": measured_link_gbit(connection, inventory),
    }


def _pairs(connection: Connection, run_dir: str) -> list[dict]:
    """The run's kept predicted-vs-measured pairs (predictions.json, a JSON list)."""
    pairs = remote.read_json(connection, f"{run_dir}/{rd.PREDICTIONS}")
    return [p for p in pairs if isinstance(p, dict)] if isinstance(pairs, list) else []


def list_runs(connection: Connection, inventory: Inventory) -> list[noderecords.RunFiles]:
    """Every run on /data: its run-status, progress, summary, config, segments and phases (one round trip)."""
    return noderecords.listing(connection, inventory)


def run_row(run: noderecords.RunFiles, usd_per_node_hour: Optional[float], slots: int = 1) -> dict:
    """One line of `fab runs`: what two runs are compared by."""
    summary, progress, config = run.summary, run.progress, run.config
    step_s = (summary and summary.avg_step_time_s) or (progress and progress.avg_step_time_s)
    world = (summary and summary.world_size) or (progress and progress.world_size)
    nodes = max(1, world // max(1, slots)) if world else None
    wall = run_wall(run) or (summary and summary.wall_time_s)
    quality = terminal.quality(summary)
    steps = summary.steps if summary else progress.step if progress else "?"
    cost = ""
    if usd_per_node_hour is not None and wall and nodes:
        cost = f"${usd_per_node_hour * nodes * wall / 3600:.2f}"
    return {
        "run": run.run,
        "state": run.state or ("finished" if summary else "?"),
        "steps": f"{steps}/{config.get('max_steps', '?')}",
        "step_ms": f"{step_s * 1000:.0f}" if step_s else "",
        "objects/s": f"{summary.objects_per_s:.0f}" if summary and summary.objects_per_s else "",
        "mfu": f"{summary.mfu:.1%}" if summary and summary.mfu is not None else "",
        "precision": config.get("precision", ""),
        "compression": (summary and summary.grad_compression) or config.get("grad_compression", ""),
        "nodes": nodes or "",
        "quality": quality,
        "wall": (f"{wall:.0f} s" if wall < 120 else f"{wall / 60:.1f} min") if wall else "",
        "goodput": goodput.short(goodput.account(run.phases)),
        "cost": cost or "n/a",
    }


def run_wall(run: noderecords.RunFiles) -> Optional[float]:
    """The run's wall time over every segment (each `fab train` that started or resumed it), from its
    segments.json; None for a run that has none (the trainer's summary has the last segment's)."""
    return sum(s.ended - s.started for s in run.segments) if run.segments else None


RUN_COLUMNS = ["run", "state", "steps", "step_ms", "objects/s", "mfu", "precision", "compression", "nodes", "quality"]
RUN_COLUMNS.append("wall")
RUN_COLUMNS.append("goodput")


def parse_phases(rows: Sequence[dict]) -> tuple:
    return phases.parse(json.dumps(row) for row in rows)


def runs_table(runs: Sequence[noderecords.RunFiles], usd_per_node_hour: Optional[float], slots: int) -> str:
    rows = [run_row(run, usd_per_node_hour, slots) for run in runs]
    columns = RUN_COLUMNS + (["cost"] if usd_per_node_hour is not None else [])
    return terminal.table(rows, columns) if rows else "no runs yet: start one with `fab train`"


def run_scale(
    connection: Connection,
    inventory: Inventory,
    request: launch.TrainRequest,
    node_counts: Sequence[int],
    repeat: int,
    code_dir: str,
    say: Callable[[str], None] = print,
) -> list[scaling.Point]:
    """Short runs on each node count, `repeat` times each, fresh every time; their points."""
    points = []
    for nodes in node_counts:
        summaries = []
        for attempt in range(1, repeat + 1):
            name = scale_run(request.recipe, nodes, attempt)
            rdir = launch.run_dir(inventory, name)
            remote.sh(connection, f"rm -rf {q(rdir)}")
            one = dataclasses.replace(request, run=name, nodes=nodes)
            say(f"{name}: {request.steps} steps on {nodes} node(s), {attempt} of {repeat} ...")  # 10-14 s each
            rdir, _ = lifecycle.start_training(
                connection, inventory, lifecycle.plan_launch(connection, inventory, one, code_dir)
            )
            status = lifecycle.follow_log(connection, inventory, rdir, out=_Discard(), timeout=3600)
            summary = noderecords.read(connection, inventory, rdir, rd.SUMMARY).summary
            if status is None or status.state != rd.RunState.FINISHED or not summary:
                raise remote.RemoteError(
                    f"{name} {status and status.state}: {status and status.reason} (see {rdir}/{rd.TRAIN_LOG})"
                )
            summaries.append(summary)
            step_ms, rate = (summary.avg_step_time_s or 0) * 1000, summary.objects_per_s or 0
            say(f"{name}: {step_ms:.0f} ms/step, {rate:.0f} objects/s")
        points.append(scaling.point_from_summaries(nodes, summaries))
    return points


class _Discard:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def write_scale(connection: Connection, inventory: Inventory, recipe: str, points, local_dir: Path) -> list[Path]:
    """scale.json, scale.md and scaling.png locally and into the series directory on /data."""
    local_dir.mkdir(parents=True, exist_ok=True)
    speedups, spreads = scaling.speedups(points)
    table = scaling.table(points, scaling.shared_cores(inventory.source))
    record = {"recipe": recipe, "points": [point.__dict__ for point in points]}
    (local_dir / rd.SCALE_JSON).write_text(json.dumps(record, indent=2))
    (local_dir / rd.SCALE_MD).write_text(f"# Scaling: {recipe}\n\n```\n{table}\n```\n\n![scaling]({rd.SCALING_PNG})\n")
    nodes = [p.nodes for p in points]
    written = [local_dir / rd.SCALE_JSON, local_dir / rd.SCALE_MD]
    written.append(plots.scaling_curve(nodes, speedups, spreads, local_dir / rd.SCALING_PNG, f"{recipe}: weak scaling"))
    target = scale_dir(inventory, recipe)
    remote.sh(connection, f"mkdir -p {q(target)}")
    for path in written:
        connection.put(str(path), f"{target}/{path.name}")
    # The series and its short runs are home (their figures are scale.json): fetched, for fab local.down.
    runs = [target] + [launch.run_dir(inventory, name) for name in scale_runs(recipe, points)]
    remote.sh(connection, "touch " + " ".join(q(f"{run}/{rd.FETCHED}") for run in runs))
    return written


@dataclasses.dataclass(frozen=True)
class Scaled:
    """`fab scale`'s result: the table, the files written here and the series' directory on the cluster."""

    table: str
    written: list[Path]
    cluster_dir: str


def scale(
    connection: Connection,
    inventory: Inventory,
    request: launch.TrainRequest,
    node_counts: Sequence[int],
    repeat: int,
    code_dir: str,
    local_dir: Path,
) -> Scaled:
    """`fab scale`'s use case: the short runs (run_scale), then their files here and on /data (write_scale)."""
    points = run_scale(connection, inventory, request, node_counts, repeat, code_dir)
    written = write_scale(connection, inventory, request.recipe, points, local_dir)
    table = scaling.table(points, scaling.shared_cores(inventory.source))
    return Scaled(table, written, scale_dir(inventory, request.recipe))


def scale_runs(recipe: str, points) -> list[str]:
    """The names of the short runs behind the points (run_scale's)."""
    return [scale_run(recipe, p.nodes, attempt) for p in points for attempt in range(1, len(p.step_s) + 1)]


def scale_run(recipe: str, nodes: int, attempt: int) -> str:
    return f"{rd.SCALE_DIR.format(recipe=recipe)}-n{nodes}-r{attempt}"
