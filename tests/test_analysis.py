"""fab report / runs / scale / monitor on real summary shapes, without a cluster."""

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from invoke.exceptions import Exit
from runfiles import full_status, read_here, run_files
from test_launch import inventory

from cluster_node.protocol.rundir import Summary
from clusterops.predict import bottleneck, scaling
from clusterops.run import analysis
from fabfile.analysis import node_counts

# The shape the trainer writes (summary.json of a 2-node transformer-tiny run, trimmed).
SUMMARY = {
    "recipe": "transformer-tiny",
    "steps": 30,
    "world_size": 2,
    "global_batch": 64,
    "avg_step_time_s": 0.31,
    "objects_per_s": 206.0,
    "bleu": 12.5,
    "precision": "fp32",
    "grad_compression": "none",
    "wall_time_s": 95.0,
    "breakdown": {
        "data_s": 0.01,
        "compute_s": 0.2,
        "comm_exposed_s": 0.08,
        "optimizer_s": 0.01,
        "other_s": 0.01,
        "wire_bytes": 5.2e6,
        "grad_bytes": 5.2e6,
        "single_bucket": False,
    },
    "calibration": {"overhead_s": {"fp16": 0.003, "bf16": 0.003, "powersgd": 0.01}, "powersgd_wire_bytes": 4e5},
}


def test_report_without_a_link_measurement_says_so_and_predicts_only_the_batch(tmp_path):
    lines, written = bottleneck.write_report("tiny", Summary.from_json(SUMMARY), None, tmp_path)
    text = "\n".join(lines)
    assert "No link measurement" in text and "fab check" in text
    names = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "what if" not in line]
    assert names == ["none", "batch x2 per GPU", "batch x4 per GPU"]
    assert [p.name for p in written] == ["report.md", "breakdown.png"]


def test_report_with_the_link_and_a_scale_series_draws_both_plots(tmp_path):
    link = {"median_gbit": 0.95, "pairs": [{"src": "node0", "dst": "node1", "gbit": 0.95}], "allreduce_busbw_gbit": 0.9}
    point = scaling.Point(2, 2, [0.31, 0.33], [206.0, 194.0], [0.25, 0.27])
    scale = {"recipe": "transformer-tiny", "points": [scaling.Point(1, 1, [0.3], [107.0], []).__dict__, point.__dict__]}
    lines, written = bottleneck.write_report("tiny", Summary.from_json(SUMMARY), link, tmp_path, scale)
    assert lines[0] == "# Run tiny: mixed"  # 26% of the step is exposed communication
    assert any("median 0.95 Gbit/s over 1 pair" in line for line in lines)
    assert any(line.startswith("| powersgd |") for line in lines)
    assert sorted(p.name for p in written) == ["breakdown.png", "report.md", "scaling.png"]
    assert "weak scaling" in (tmp_path / "report.md").read_text()


GPU_SUMMARY = {
    **SUMMARY,
    "mfu": 0.083,
    "mfu_peak": {"device": "NVIDIA H100 80GB HBM3", "tflops": 989.0},
    "warmup": {"settled": True, "note": "settled after 175 steps", "warmup_steps": 175, "warmup_s": 21.4,
               "steady_steps": 225, "steady_step_s": 0.063},
}  # fmt: skip


def test_the_report_gives_the_mfu_the_warm_up_and_far_from_the_peak_what_a_larger_batch_would_give(tmp_path):
    """Issue 29 §3-4: the steady step's MFU against the GPU's datasheet peak, the warm-up the step time leaves
    out, and at 8% MFU the what-if model's 4x batch (as `--verify batchx4` would run it)."""
    link = {"median_gbit": 10.0, "link_gbit": 10.0, "pairs": [{}], "measured_at": "now"}
    lines, _ = bottleneck.write_report("gpu", Summary.from_json(GPU_SUMMARY), link, tmp_path)
    assert "- MFU: 8.3% of NVIDIA H100 80GB HBM3's 989 TFLOP/s (datasheet, dense 16-bit) over the steady step" in lines
    assert (
        "- warm-up: 175 steps, 21.4 s until the step time settled; the step time is the mean of 225 steady steps"
        in lines
    )
    warmed = {**GPU_SUMMARY, "warmup": {**GPU_SUMMARY["warmup"], "shapes_warmed": 42, "shape_warm_s": 3.2}}
    lines_warmed = bottleneck.write_report("gpu", Summary.from_json(warmed), link, tmp_path)[0]
    assert "- warm-up (after 42 batch shapes run once in 3.2 s): 175 steps, 21.4 s until" in "\n".join(lines_warmed)
    [far] = [line for line in lines if line.startswith("MFU 8.3% is far from the GPU's peak")]
    measured = {
        **link,
        "matmul_peak": {"measured_tflops": 700.0, "dtype": "bfloat16", "device": "NVIDIA H100 80GB HBM3"},
    }
    checked = bottleneck.write_report("gpu", Summary.from_json(GPU_SUMMARY), measured, tmp_path)[0]
    assert any(x.endswith("; `fab check` measured 700 TFLOP/s bfloat16 on it: 11.7% of that") for x in checked), checked
    speedup = float(re.search(r"predicts ([\d.]+)x objects/s", far).group(1))
    assert speedup > 1 and f"MFU about {min(1.0, 0.083 * speedup):.0%}" in far and "--verify batchx4" in far
    cpu = bottleneck.write_report("cpu", Summary.from_json(SUMMARY), link, tmp_path)[0]
    assert "- MFU: not measured (this device: no tensor-core peak known)" in cpu and not any(
        "far from" in x for x in cpu
    )
    assert "- warm-up: not recorded (an older trainer): the step time includes it" in cpu
    row = analysis.run_row(run_files("gpu", summary=GPU_SUMMARY, config={"max_steps": 400}), None)
    assert row["mfu"] == "8.3%" and analysis.run_row(run_files("cpu", summary=SUMMARY), None)["mfu"] == ""


def test_runs_table_compares_runs_at_a_glance():
    runs = [
        run_files("tiny", summary=SUMMARY, config={"max_steps": 30, "precision": "fp32"}, status={"state": "finished"}),
        run_files(
            "going",
            progress={"step": 12, "avg_step_time_s": 0.5, "world_size": 4},
            config={"max_steps": 100, "precision": "bf16", "grad_compression": "powersgd"},
            status={"state": "running"},
        ),
    ]
    table = analysis.runs_table(runs, usd_per_node_hour=0.526, slots=1).splitlines()
    assert table[0].split() == analysis.RUN_COLUMNS + ["cost"]
    assert table[2].split()[:9] == ["tiny", "finished", "30/30", "310", "206", "fp32", "none", "2", "BLEU"]
    assert re.search(r"BLEU 12.5  95 s +\$0.03$", table[2])  # (no phases.jsonl: an empty goodput)
    assert table[3].split()[:8] == ["going", "running", "12/100", "500", "bf16", "powersgd", "4", "n/a"]
    assert "cost" not in analysis.runs_table(runs, None, 1).splitlines()[0]
    # Issue 32 §11: "top-1 78.000" beside "BLEU 0.1": one form for both
    image = run_files(
        "img", summary={k: v for k, v in SUMMARY.items() if k != "bleu"} | {"top1": 78.0}, status={"state": "finished"}
    )
    assert "top-1 78.0%" in analysis.runs_table([image], None, 1).splitlines()[2]


def test_the_runs_script_reads_every_run_directory(tmp_path):
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    (run / "run-status.json").write_text('{"state": "finished"}')
    (tmp_path / "runs" / "scale-transformer-tiny").mkdir()  # a scale series, not a run
    out = subprocess.run(
        [sys.executable, "-m", "cluster_node.programs.runs", "list", "--data", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    rows = json.loads(out.stdout)
    assert [r["run"] for r in rows] == ["tiny"] and rows[0]["files"]["run-status.json"] == {"state": "finished"}


@pytest.mark.parametrize("text, counts", [("1,2", [1, 2]), ("2,1,2", [1, 2]), ("4", [4])])
def test_node_counts(text, counts):
    assert node_counts(text, 4) == counts


@pytest.mark.parametrize("text", ["", "1,,2", "0,1", "1,8", "a"])
def test_bad_node_counts_are_one_line(text):
    with pytest.raises(Exit, match=r"^error: invalid --nodes"):
        node_counts(text, 4)


@pytest.mark.parametrize("rate, gbit", [("1gbit", 1.0), ("100mbit", 0.1), ("2.5gbit", 2.5), (None, None), ("x", None)])
def test_tc_rates(rate, gbit):
    assert analysis.tc_rate_gbit(rate) == (pytest.approx(gbit) if gbit else None)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def test_the_monitor_probe_counts_this_namespaces_cpu_and_the_interfaces_bytes():
    """The probe runs as is on this machine: a busy child process shows up as CPU of this network
    namespace (at least what it used meanwhile, however loaded the machine is), and a process that
    ends during the sample, after a second of CPU, does not cancel it out."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    ending = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(1.0)
        before, started = _cpu_ticks(busy.pid), time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "cluster_node.programs.sample", "lo", "1.0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        busy_cores = (_cpu_ticks(busy.pid) - before) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - started)
    finally:
        busy.kill()
        ending.wait()
    rx, tx, seconds, cores, cpus, gpu = out
    assert int(rx) >= 0 and int(tx) >= 0 and 0.9 < float(seconds) < 3
    assert 0.7 * busy_cores <= float(cores) <= int(cpus) and busy_cores > 0.1 and gpu == "none", (cores, busy_cores)


@pytest.mark.parametrize(
    "nodes, cpus, slices",
    [
        (2, [0, 1], [[0], [1]]),  # this machine: a core each
        (1, [0, 1], [[0, 1]]),
        (3, [0, 1], [[0, 1], [0, 1], [0, 1]]),  # more nodes than cores: all of them, shared equally
        (2, [0, 1, 2, 3, 4], [[0, 1], [2, 3]]),
    ],
)
def test_each_emulated_node_gets_its_own_cpus(nodes, cpus, slices):
    from clusterops.local.cluster import node_cpus

    assert [node_cpus(rank, nodes, cpus) for rank in range(nodes)] == slices


def test_the_scale_table_shows_no_spread_for_one_repeat_and_notes_crowded_cores():
    """`fab scale --repeat 1` printed "± 0" (no spread was measured), and 3 ranks on a 2-core machine
    looked like poor scaling with no word why (issue 23 §13)."""
    from clusterops.predict import scaling

    points = [scaling.Point(1, 1, [0.10], [100.0], []), scaling.Point(3, 3, [0.20], [150.0], [])]
    text = scaling.table(points, shared_cores=2)
    assert "±" not in text.split("\n", 2)[-1] and "one repeat each" in text
    assert "3 ranks share this machine's 2 cores" in text
    repeated = [
        scaling.Point(1, 1, [0.1, 0.1], [100.0, 110.0], []),
        scaling.Point(2, 2, [0.1, 0.1], [190.0, 200.0], []),
    ]
    text = scaling.table(repeated, shared_cores=None)
    assert "105 ± 5" in text and "note:" not in text


def test_report_on_a_failed_run_reports_what_it_measured_up_to_its_end(tmp_path, monkeypatch):
    """`fab report` on a failed run said "the run has not ended" (issue 23 §8): a run that wrote no
    summary.json is reported from its last progress record, with its state; one that logged no step
    gets one line naming its state."""
    import shutil

    from clusterops.nodes import records as noderecords
    from clusterops.nodes import remote
    from clusterops.run import analysis

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "run-status.json").write_text(json.dumps(full_status(state="failed", reason="node1 unreachable")))
    (run / "config.json").write_text(json.dumps({"recipe": "transformer-tiny", "batch_per_gpu": 8, "grad_accum": 1}))
    monkeypatch.setattr(
        remote, "read_json", lambda _c, path: json.loads(Path(path).read_text()) if Path(path).exists() else None
    )
    monkeypatch.setattr(noderecords, "read", read_here)
    monkeypatch.setattr(remote, "sh", lambda _c, command, **_: "")  # phases.jsonl: none, no goodput

    class Put:
        def put(self, local, target):
            shutil.copy(local, target)

    with pytest.raises(remote.RemoteError, match="r1 is failed \\(node1 unreachable\\) and logged no step"):
        analysis.report_run(Put(), replace(inventory(), data_dir=str(tmp_path)), str(run))
    parts = {"data_s": 0.01, "compute_s": 0.05, "comm_exposed_s": 0.04, "optimizer_s": 0.0, "other_s": 0.0}
    progress = {"step": 55, "max_steps": 300, "world_size": 2, "avg_step_time_s": 0.1, "breakdown": parts}
    (run / "progress.json").write_text(json.dumps(progress))
    lines = analysis.report_run(Put(), replace(inventory(), data_dir=str(tmp_path)), str(run))
    assert lines[0].startswith("run r1 is failed (node1 unreachable): measured up to step 55/300")
    assert any("exposed communication 40%" in line for line in lines)
    assert (run / "report.md").exists() and "what if" not in (run / "report.md").read_text()
