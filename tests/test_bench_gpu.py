"""scripts/bench_gpu.py's smoke run on a CPU: every measurement and peer it runs on a GPU, at tiny
sizes, each trainer a process of its own (the plain loops too in the profile's run); the table, the
issue's bounds, the step times by window and the JSON. The figures themselves mean nothing on a CPU:
only that each was measured."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_smoke_run_measures_everything_and_writes_the_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["machine"]["datasheet_tflops"] is None
    failed = {name: r for name, r in result["results"].items() if "error" in r or "skipped" in r}
    assert not failed, failed
    expected = {
        f"{label}: {what}"
        for label in ("budget", "16k")
        for what in (
            "trainer",
            "trainer resumed",
            "plain, trainer's batches, torch SDPA",
            "plain, trainer's batches, flash/efficient",
            "plain, fixed shape",
        )
    }
    expected |= {"resnet50 synthetic: trainer", "resnet50 synthetic: plain", "resnet50 jpegs: trainer"}
    expected |= {"resnet50 synthetic, --precision bf16: trainer", "budget, no host-buffer reservation: trainer"}
    expected |= {"budget, --attention torch: trainer", "budget, --pad-multiple 1: trainer", "data"}
    expected |= {"budget, --pad-multiple 4: trainer", "budget, --warm-shapes 0: trainer"}
    expected |= {"budget, flags by assignment (before session 28): trainer"}
    expected |= {"resnet50 jpegs, decoded as before session 28: trainer"}
    ways = ("host buffers pageable", "host buffers page-locked", "host buffers pageable, again")
    expected |= {f"budget, {way}: trainer" for way in ways}
    assert set(result["results"]) == expected | {"launch contention"}
    assert result["results"]["launch contention"] == {"cuda": False}  # no launches to slow on a CPU
    for name in expected - {"data"}:
        measured = result["results"][name]
        assert measured["steady_step_s"] > 0 and measured["first_step_s"] > 0, name
        assert measured["windows_ms"] and all(w > 0 for w in measured["windows_ms"]), name
    resumed = result["results"]["budget: trainer resumed"]
    assert resumed["steps"] == 110 and resumed["first_50_mean_s"] > 0
    text = result["results"]["budget: trainer"]
    assert text["flops_per_step"] > 0 and text["distinct_shapes"] >= 1 and 0 < text["padded_fraction"] < 0.5
    assert len(result["checks"]) == 12 and all(c["value"] is not None for c in result["checks"])
    assert "| budget: trainer (peer: " in done.stdout and "issue 29 bounds:" in done.stdout
    assert "\n  budget: trainer resumed: " in done.stdout  # its step times by window
    assert result["results"]["budget, --pad-multiple 4: trainer"]["objects_per_s"] > 0
    assert "sentence pairs a second, steady (the padding variants' batches differ): budget " in done.stdout
    # The trainer against the plain loop on its own batches, step for step (not the resume: other steps).
    assert re.search(
        r"\n  budget, host buffers pageable: trainer, steps \d+-\d+: [\d.]+ ms, plain [\d.]+ ", done.stdout
    )
    assert "\n  budget: trainer, steps " in done.stdout and "trainer resumed, steps" not in done.stdout


def test_the_profile_run_sets_the_trainer_beside_its_plain_peer_over_the_same_steps(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--smoke", "--profile", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    trainer, plain = results["budget: trainer, profiled"], results["budget: plain, trainer's batches, profiled"]
    for profiled in (trainer, plain, results["budget: plain, fixed shape, profiled"]):
        assert profiled["steps"] == 5 and profiled["wall_ms"] > 0 and profiled["self_cpu_ms"] > 0
        assert any(op[0] == "aten::mm" and op[1] > 0 for op in profiled["top"])  # the model's matrix products
    assert "| kernel launches |" in done.stdout and "| aten::mm |" in done.stdout
    assert "| plain loop, one shape |" in done.stdout


def test_a_measurement_that_outruns_its_time_keeps_what_its_process_said(tmp_path, monkeypatch):
    """A --compile trainer past the budget on an H100 left only "timed out": how far it got was lost."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # its neighbours, as a script's run finds them
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    args = type("Args", (), {"smoke": False, "budget_s": 60.0, "json": str(tmp_path / "b.json")})()
    bench = bench_gpu.Bench(args, tmp_path)
    child = "import sys, time; print('step 1/300 | first step 97000 ms', flush=True); time.sleep(30)"
    with pytest.raises(RuntimeError, match=r"still running after 1 s: step 1/300 \| first step 97000 ms"):
        bench.process([sys.executable, "-c", child], timeout=1)


def test_the_trainer_and_the_plain_loop_are_compared_over_the_same_steps(monkeypatch):
    """The trainer's windows start with its step 1 (start-up), the plain loop's with steps 2-11: the same
    steps (the same batches) from where both settled, to where either ends."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gpu_report

    trainer = {"windows_ms": [900.0, 80, 70, 60, 50, 40, 30], "warmup_steps": 20, "settled": True}
    plain = {"windows_ms": [8, 7, 6, 5, 4], "warmup_steps": 30, "settled": True}
    mine, theirs, first, last = gpu_report.same_steps(trainer, plain)
    assert (first, last) == (32, 51)  # windows 3 and 4: steps 32-41 and 42-51
    assert mine == pytest.approx(0.045) and theirs == pytest.approx(0.0045)
    unsettled = gpu_report.same_steps(trainer, dict(plain, settled=False, warmup_steps=None))
    assert unsettled[2:] == (32, 51)  # a run that never settled: its second half
    assert gpu_report.same_steps(dict(trainer, warmup_steps=40), plain) is None  # one window left: too few
