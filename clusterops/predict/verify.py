"""`fab report --verify MODE`: the model's prediction for one what-if of a run, against a short run
that makes it (MODE: a compression, `batchx2`/`batchx4`, or `nodes=K` at the same global batch).
The pairs are kept in the run directory (rundir.PREDICTIONS) so `fab report` shows how well the
model has done on this cluster."""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Optional, Sequence

from cluster_node.protocol.rundir import Summary
from clusterops.predict import plan as planning
from clusterops.predict.bottleneck import MODES, Breakdown, what_ifs
from train.config import RESUMABLE_CHANGES

VERIFY_STEPS = 20  # the short run: its first 5 steps are not timed (the trainer's summary)
# The run's settings the short run does not take as flags: where it runs, its length and reporting
# (fab's own short-run flags), and what changes() sets.
# world_size: the ranks the run trained on (train.compose records it beside the settings), not a trainer flag
NOT_KEPT = {"recipe", "data", "run_dir", "max_steps", "batch_per_gpu", "grad_compression", "world_size"}
NOT_KEPT |= RESUMABLE_CHANGES


class VerifyError(ValueError):
    """A MODE the model has no what-if for, or a run it cannot be scored against."""


def parse_mode(text: str) -> tuple[str, Optional[int]]:
    """("compression" | "batch" | "nodes", its value)."""
    text = (text or "").strip()
    if text in MODES:
        return "compression", None
    found = re.fullmatch(r"batchx([24])|nodes=(\d+)", text)
    if not found:
        raise VerifyError(f"invalid --verify {text!r}: one of {', '.join(MODES)}, batchx2, batchx4, nodes=K")
    return ("batch", int(found.group(1))) if found.group(1) else ("nodes", int(found.group(2)))


WORK = ("compute", "optimizer")  # the parts of a step a compression leaves as they were


def predict(summary: Summary, link_gbit: Optional[float], mode: str, slots: int) -> tuple[float, str, dict]:
    """The model's step for MODE from the run's breakdown: seconds, the one-line model, and the compute
    and optimizer step in it (the run's own compute, or scaled by the rank's share of the batch)."""
    b = Breakdown.from_summary(summary.to_json())  # the step model reads summary.json's JSON
    kind, value = parse_mode(mode)
    if kind == "nodes":
        ranks = int(value or 1) * slots
        base = planning.Base(b, planning.CPU, slots, link_gbit, "")
        work = {"compute": b.compute * b.world_size / ranks, "optimizer": b.optimizer}
        return (*planning.step_at(base, ranks, link_gbit), work)
    if not link_gbit:
        raise VerifyError("no link rate (run `fab check`): the compression and batch what-ifs need it")
    wanted = f"batch x{value} per GPU" if kind == "batch" else ("none" if mode == "none" else mode)
    for p in what_ifs(b, link_gbit):
        if p.name.split()[0] == wanted or p.name == wanted:
            parts = dict(p.parts)
            return p.step_s, p.model, {part: parts[part] for part in WORK}
    raise VerifyError(f"the model has no {mode} what-if for this run (PowerSGD needs its calibration)")


def changes(config: dict, summary: Summary, mode: str, slots: int) -> dict:
    """The short run's TrainRequest fields: the run's own settings with MODE's one change."""
    kind, value = parse_mode(mode)
    world = int(summary.world_size or 1)
    batch = int(config.get("batch_per_gpu") or 1)
    fields = {
        "recipe": summary.recipe or config.get("recipe"),
        "steps": VERIFY_STEPS,
        "batch_per_gpu": batch,
        "grad_compression": summary.grad_compression or "none",
        "nodes": max(1, world // slots),
        "data": config.get("data"),
        "extra_args": kept_args(config),
    }
    if kind == "compression":
        fields["grad_compression"] = mode
    elif kind == "batch":
        fields["batch_per_gpu"] = batch * int(value or 1)
    else:
        ranks = int(value or 1) * slots
        if (batch * world) % ranks:
            raise VerifyError(f"the global batch {batch * world} does not split over {ranks} rank(s)")
        fields.update(nodes=int(value or 1), batch_per_gpu=batch * world // ranks)
    return fields


def kept_args(config: dict) -> tuple[str, ...]:
    """The run's trainer settings as flags (its model, batching, precision, optimizer, DDP buckets),
    so the short run trains what the run trained: config.json's fields, the task's model part only."""
    part = "vision" if str(config.get("recipe", "")).startswith("resnet") else "model"
    settings = [*((k, v) for k, v in config.items() if k not in ("model", "vision")), *config.get(part, {}).items()]
    args: list[str] = []
    for key, value in settings:
        if key in NOT_KEPT or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args += [flag, "true" if value else "false"]
        else:
            args += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return tuple(args)


def pair(mode: str, predicted: float, model: str, measured: float, run: str, work: tuple = (None, None)) -> dict:
    """A scored prediction. `work`: the compute and optimizer step the model put in it, and those the short
    run measured (each a {part: seconds} dict, or None). A compression leaves that work as it was, yet its
    times move between two runs by as much as the model misses (a machine's clocks, heat and neighbours; on
    shared cores, the traffic beside it): with the measured work in place of the predicted, the error left
    is the model's own, its communication and overlap. A batch or node what-if predicts the compute
    itself: its error is not taken out."""
    predicted_work, measured_work = work
    given = None
    if measured and predicted_work and measured_work and parse_mode(mode)[0] == "compression":
        given = (predicted + sum(measured_work[k] - predicted_work[k] for k in WORK)) / measured - 1
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": mode,
        "predicted_s": predicted,
        "measured_s": measured,
        "error": predicted / measured - 1 if measured else None,
        "predicted_work_s": predicted_work,
        "measured_work_s": measured_work,
        "error_given_work": given,
        "model": model,
        "run": run,
    }


def scored_line(p: dict) -> str:
    """What `fab report --verify` prints of its pair."""
    line = (
        f"{p['mode']}: predicted {p['predicted_s'] * 1e3:.0f} ms/step ({p['model']}), measured "
        f"{p['measured_s'] * 1e3:.0f} ms in {p['run']}: error {p['error']:+.0%}"
    )
    predicted, measured = p.get("predicted_work_s"), p.get("measured_work_s")
    if not predicted or not measured:
        return line
    work = ", ".join(f"{k} {measured[k] * 1e3:.0f} ms against {predicted[k] * 1e3:.0f} predicted" for k in WORK)
    if p.get("error_given_work") is None:
        return f"{line}; its {work}"
    return f"{line}; {p['error_given_work']:+.0%} given the work it measured ({work})"


def _percent(value: Optional[float]) -> str:
    return "" if value is None else f"{value:+.0%}"


def lines(pairs: Sequence[dict]) -> list[str]:
    """The report's section: every scored what-if, and the mean absolute errors."""
    if not pairs:
        return []
    out = ["", "## Predictions scored on this cluster", ""]
    out += ["| what if | predicted | measured | error | given its work | run |", "|---|---|---|---|---|---|"]
    for p in pairs:
        out.append(
            f"| {p['mode']} | {p['predicted_s'] * 1e3:.0f} ms | {p['measured_s'] * 1e3:.0f} ms | "
            f"{_percent(p.get('error'))} | {_percent(p.get('error_given_work'))} | {p.get('run', '')} |"
        )
    errors = [abs(p["error"]) for p in pairs if p.get("error") is not None]
    given = [
        abs(p["error_given_work"])
        for p in pairs
        if p.get("error_given_work") is not None and parse_mode(p["mode"])[0] == "compression"
    ]
    if errors:
        mean = f"mean absolute error {sum(errors) / len(errors):.0%} over {len(errors)} prediction(s)"
        if given:
            count = len(given)
            mean += f"; {sum(given) / count:.0%} over the {count} compression(s), given each one's measured work"
        out += ["", mean]
    return out


def replaced(request, fields: dict, run: str):
    """The short run's request: fab's short-run reporting flags after the run's own settings."""
    extra = (*fields.get("extra_args", ()), *request.extra_args)
    return dataclasses.replace(request, run=run, **{**fields, "extra_args": extra})
