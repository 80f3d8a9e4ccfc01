"""scripts/bench_gpu.py's table and the issue 29 bounds it checks (from its results dict)."""

from __future__ import annotations

import platform

import torch
from gpu_peers import WINDOW

# (what, bound): the "done means"
BOUNDS = {
    "steady / plain, trainer's batches with masks": 1.10,
    "the same steps / plain, trainer's batches with masks": 1.10,
    "steady / plain, one fixed shape": 1.25,
    "first 50 steps / steady": 1.30,
    "after a resume: first 50 steps / steady": 1.30,
    "synthetic: steady / plain": 1.00,
    "jpegs: data wait / step": 0.05,
}


def machine() -> dict:
    from gpu_peers import matmul_tflops

    from train.perf import peak_tflops

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    try:
        measured = matmul_tflops()
    except Exception as error:  # a figure beside the datasheet's; its absence loses nothing else
        measured = f"{type(error).__name__}: {error}"
    return {
        "device": name,
        "torch": torch.__version__,
        "datasheet_tflops": peak_tflops(name),
        "matmul_tflops": measured,
    }


def _get(results: dict, name: str, key: str):
    value = results.get(name) or {}
    return value.get(key) if isinstance(value, dict) else None


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def plain_peer(results: dict, label: str) -> tuple[float | None, str]:
    """The faster of the two plain loops fed the trainer's batches (torch's SDPA choice, or pinned)."""
    found = []
    for peer in ("torch SDPA", "flash/efficient"):
        step = _get(results, f"{label}: plain, trainer's batches, {peer}", "steady_step_s")
        if step:
            found.append((step, peer))
    return min(found) if found else (None, "")


def same_steps(trainer: dict, plain: dict) -> tuple[float, float, int, int] | None:
    """The trainer's and the plain loop's mean step over the same steps (the plain loop is fed the trainer's
    own batches in order), from where both are steady to where either ends: (trainer s, plain s, first
    step, last step). A steady mean over different steps compares different batch shapes: in session 23
    the trainer's steps 30-300 against the plain loop's 80-150 said 1.16x, the same steps 1.28x."""
    mine, theirs = (trainer.get("windows_ms") or [])[1:], plain.get("windows_ms") or []  # the trainer's step 1 first
    last = min(len(mine), len(theirs))  # window i: steps 2 + 10i to 11 + 10i
    # A run that never settled: its second half.
    steady = max((r.get("warmup_steps") or 0) if r.get("settled") else WINDOW * last // 2 for r in (trainer, plain))
    first = -(-steady // WINDOW)
    if last - first < 2:
        return None
    mean = lambda windows: sum(windows[first:last]) / (last - first) / 1000  # noqa: E731
    return mean(mine), mean(theirs), 2 + WINDOW * first, 1 + WINDOW * last


def _same(results: dict, name: str, plain: str):
    found = same_steps(results.get(name) or {}, results.get(plain) or {})
    return _ratio(found[0], found[1]) if found else None


def checks(results: dict) -> list[dict]:
    out = []

    def check(what: str, label: str, value) -> None:
        bound = BOUNDS[what]
        out.append(
            {"check": f"{label}: {what}", "value": value, "bound": bound, "ok": value is not None and value <= bound}
        )

    for label in ("budget", "16k"):
        trainer = f"{label}: trainer"
        steady = _get(results, trainer, "steady_step_s")
        step, peer = plain_peer(results, label)
        check("steady / plain, trainer's batches with masks", label, _ratio(steady, step))
        same = _same(results, trainer, f"{label}: plain, trainer's batches, {peer}") if peer else None
        check("the same steps / plain, trainer's batches with masks", label, same)
        fixed = _get(results, f"{label}: plain, fixed shape", "steady_step_s")
        check("steady / plain, one fixed shape", label, _ratio(steady, fixed))
        check("first 50 steps / steady", label, _ratio(_get(results, trainer, "first_50_mean_s"), steady))
        resumed = _get(results, f"{label}: trainer resumed", "first_50_mean_s")
        check("after a resume: first 50 steps / steady", label, _ratio(resumed, steady))
    resnet = _get(results, "resnet50 synthetic: trainer", "steady_step_s")
    check(
        "synthetic: steady / plain",
        "resnet50",
        _ratio(resnet, _get(results, "resnet50 synthetic: plain", "steady_step_s")),
    )
    check("jpegs: data wait / step", "resnet50", _get(results, "resnet50 jpegs: trainer", "data_wait"))
    return out


def _rate(tflops) -> str:
    return f"{tflops:.0f} TFLOP/s" if isinstance(tflops, float) else str(tflops)


def _ms(seconds) -> str:
    return f"{seconds * 1000:.1f}" if isinstance(seconds, (int, float)) else "-"


def _x(value) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else "-"


def _row(results: dict, name: str, plain: float | None, fixed: float | None, resumed: str | None) -> str:
    r = results.get(name) or {}
    if "steady_step_s" not in r:
        return f"| {name} | {r.get('error') or r.get('skipped') or 'not run'} |" + " |" * 8
    steady = r["steady_step_s"]
    first = _x(_ratio(r.get("first_50_mean_s"), steady))
    after = _x(_ratio(_get(results, resumed, "first_50_mean_s"), steady)) if resumed else "-"
    warm = f"{r['warmup_steps']} ({r['warmup_s']:.1f} s)" if r.get("settled") else "not settled"
    if r.get("shapes_warmed"):  # perf.warm_shapes, before step 1
        warm += f" after {r['shapes_warmed']} shapes in {r.get('shape_warm_s') or 0:.1f} s"
    mfu = f"{(r.get('flops_per_step') or 0) / 1e12:.2f}" + (f", {r['mfu']:.1%}" if r.get("mfu") is not None else "")
    shapes = f"{r.get('distinct_shapes')}, {r['padded_fraction']:.1%}" if r.get("padded_fraction") is not None else "-"
    return (
        f"| {name} | {_ms(steady)} | {_ms(plain)} ({_x(_ratio(steady, plain))}) | {_ms(fixed)} "
        f"({_x(_ratio(steady, fixed))}) | {first} | {after} | {warm} | {r.get('data_wait') or 0:.1%} | {mfu} "
        f"| {shapes} |"
    )


def table(results: dict, machine: dict) -> str:
    lines = [
        f"\n{machine['device']}, torch {machine['torch']}; MFU against {machine['datasheet_tflops']} TFLOP/s "
        f"(datasheet; a bf16 8192^3 product measured {_rate(machine['matmul_tflops'])})\n",
        "| run | steady ms | plain, its batches + masks, ms (ratio) | plain, fixed shape, ms (ratio) "
        "| first 50 / steady | after resume: first 50 / steady | warm-up steps (s) | data wait | TFLOP/step, MFU "
        "| shapes, padded |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in ("budget", "16k"):
        plain, peer = plain_peer(results, label)
        fixed = _get(results, f"{label}: plain, fixed shape", "steady_step_s")
        lines.append(_row(results, f"{label}: trainer", plain, fixed, f"{label}: trainer resumed"))
        if peer:
            lines[-1] = lines[-1].replace(f"| {label}: trainer |", f"| {label}: trainer (peer: {peer}) |")
    plain, _ = plain_peer(results, "budget")
    fixed = _get(results, "budget: plain, fixed shape", "steady_step_s")
    variants = (
        "budget, --pad-multiple 4: trainer",
        "budget, --warm-shapes 0: trainer",
        "budget, flags by assignment (before session 28): trainer",
        "budget, --attention torch: trainer",
        "budget, --pad-multiple 1: trainer",
    )
    ways = ("no host-buffer reservation", "host buffers pageable", "host buffers page-locked")
    reservations = [f"budget, {way}: trainer" for way in (*ways, "host buffers pageable, again")]
    for variant in (*reservations, *variants):
        other_batches = "pad-multiple" in variant  # no plain loop was fed its batches: pairs_lines compares
        lines.append(_row(results, variant, None if other_batches else plain, None if other_batches else fixed, None))
    resnet_plain = _get(results, "resnet50 synthetic: plain", "steady_step_s")
    resnets = (
        "resnet50 synthetic: trainer",
        "resnet50 jpegs: trainer",
        "resnet50 jpegs, decoded as before session 28: trainer",
    )
    for name in (*resnets, "resnet50 synthetic, --precision bf16: trainer"):
        lines.append(_row(results, name, resnet_plain, None, None))
    return "\n".join(lines)


def checks_text(found: list[dict]) -> str:
    lines = ["\nissue 29 bounds:"]
    for c in found:
        value = f"{c['value']:.3f}" if isinstance(c["value"], (int, float)) else "not measured"
        lines.append(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['check']}: {value} (bound {c['bound']})")
    return "\n".join(lines)


def details(results: dict) -> str:
    """Each run's step times by window (step 1 first: start-up) and the launch-contention figures."""
    lines = ["\nstep times, ms (step 1, then 10-step windows):"]
    for name, r in results.items():
        if isinstance(r, dict) and r.get("windows_ms"):
            shown = ", ".join(f"{w:g}" for w in r["windows_ms"][:16])
            lines.append(f"  {name}: {shown}{', ...' if len(r['windows_ms']) > 16 else ''}")
    lines += same_steps_lines(results)
    lines += pairs_lines(results)
    contention = results.get("launch contention") or {}
    if "launches_per_s_alone" in contention:
        lines.append(
            f"\nkernel launches from one thread: {contention['launches_per_s_alone']:,.0f}/s alone; while another "
            f"thread allocates a {contention['state_mb']:.0f} MB state's buffers ({contention['tensors']} tensors):"
        )
        copies = contention.get("copy_s") or {}
        lines.append(f"  a snapshot's copy from the GPU: {', '.join(f'{k} {v:.3f} s' for k, v in copies.items())}")
        for way, figures in contention.items():
            if isinstance(figures, dict) and "error" in figures:
                lines.append(f"  {way}: {figures['error']}")
            elif isinstance(figures, dict) and way != "copy_s":
                solo = f" ({figures['allocate_alone_s']:.2f} s alone)" if "allocate_alone_s" in figures else ""
                held = f"; held: {_x(figures['held_rate_vs_alone'])}" if "held_rate_vs_alone" in figures else ""
                lines.append(
                    f"  {way}: {_x(figures['launch_rate_vs_alone'])} the rate, allocation {figures['allocate_s']:.2f} s"
                    + solo
                    + held
                )
    return "\n".join(lines)


def profiles(results: dict) -> str:
    """--profile's runs side by side: per step, and the trainer's top operators by self CPU time with the
    plain loops' calls and CPU for the same operators (those that differ most first)."""
    names = (
        "budget: trainer, profiled",
        "budget: plain, trainer's batches, profiled",
        "budget: plain, fixed shape, profiled",
    )
    runs = [results.get(name) or {} for name in names]
    missing = [f"{name}: {run.get('error', 'not run')}" for name, run in zip(names, runs) if "wall_ms" not in run]
    if missing:
        return "\nprofiles: " + "; ".join(missing)
    steps = runs[0]["steps"]
    lines = [f"\n| per step, {steps} steps profiled | trainer | plain loop, its batches | plain loop, one shape |"]
    lines.append("|---|---|---|---|")
    for key, what in (("wall_ms", "wall ms"), ("self_cpu_ms", "self CPU ms"), ("device_ms", "device ms")):
        lines.append(f"| {what} | " + " | ".join(f"{run[key]:.1f}" for run in runs) + " |")
    lines.append("| kernel launches | " + " | ".join(f"{run['launches']:.0f}" for run in runs) + " |")
    ops = [{row[0]: row for row in run["top"]} for run in runs[1:]]
    lines += ["\n| operator (trainer's top by self CPU) | trainer calls, CPU ms | its batches | one shape |"]
    lines.append("|---|---|---|---|")
    rows = [(row, [found.get(row[0], [row[0], 0, 0.0, 0.0]) for found in ops]) for row in runs[0]["top"]]
    for mine, theirs in sorted(rows, key=lambda pair: pair[1][0][2] - pair[0][2]):
        cells = " | ".join(f"{r[1]:.0f}, {r[2]:.2f}" for r in (mine, *theirs))
        lines.append(f"| {mine[0][:60]} | {cells} |")
    return "\n".join(lines)


def pairs_lines(results: dict) -> list[str]:
    """The budget's trainer at each --pad-multiple in sentence pairs a second: other paddings make other
    batches (more, lighter ones at 4), so their step times do not compare; what an epoch costs does."""
    names = ("budget: trainer", "budget, --pad-multiple 4: trainer", "budget, --pad-multiple 1: trainer")
    rates = [(name, (results.get(name) or {}).get("objects_per_s")) for name in names]
    shown = [f"{name.removesuffix(': trainer')} {rate:,.0f}" for name, rate in rates if rate]
    return (
        [f"\nsentence pairs a second, steady (the padding variants' batches differ): {', '.join(shown)}"]
        if shown
        else []
    )


def same_steps_lines(results: dict) -> list[str]:
    """Each trainer run on the plain loop's batches (not a resume, not a --pad-multiple variant: other
    batches) against that loop over the same steps."""
    lines = []
    for name, r in results.items():
        text = name.startswith(("budget", "16k"))
        if not (text and isinstance(r, dict) and name.endswith(": trainer")) or "pad-multiple" in name:
            continue
        label = "16k" if name.startswith("16k") else "budget"
        plain = results.get(f"{label}: plain, trainer's batches, flash/efficient") or {}
        found = same_steps(r, plain)
        if found:
            mine, theirs, first, last = found
            lines.append(
                f"  {name}, steps {first}-{last}: {mine * 1000:.1f} ms, plain {theirs * 1000:.1f} ({_x(mine / theirs)})"
            )
    head = "\nthe same steps as the plain loop on the trainer's batches (flash/efficient), both steady (or half):"
    return [head, *lines] if lines else []
