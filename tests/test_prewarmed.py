"""The tests' pre-imported interpreter (prewarmed.py) gives a program what a fresh `python` would: its
argv, working directory, environment, sys.path[0], stdio, exit status and traceback, a seed of its own;
torchrun's variables to each rank, a failed rank ending the others, and a timeout ending them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import prewarmed
import pytest

PROBE = """
import json, os, random, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "x": os.environ.get("PROBE_X"), "rank": os.environ.get("RANK"),
                  "world": os.environ.get("WORLD_SIZE"), "random": random.random(), "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
if os.environ.get("PROBE_FAIL") == os.environ.get("RANK", "0"):
    raise ValueError("probe failed")
if os.environ.get("PROBE_SLEEP"):
    import time; time.sleep(float(os.environ["PROBE_SLEEP"]))
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "probemod.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def both(cmd: list[str], **env: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    full = dict(os.environ, **env)
    real = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=full)
    warm = prewarmed.run(cmd, env=full, timeout=60)
    return real, warm


def said(result: subprocess.CompletedProcess) -> dict:
    return json.loads(result.stdout.splitlines()[0])


@pytest.mark.parametrize("form", [["probe.py", "a", "--b"], ["-m", "probemod", "a", "--b"]], ids=["script", "module"])
def test_a_program_sees_what_a_fresh_interpreter_gives_it(probe, form):
    real, warm = both([sys.executable, *form], PROBE_X="given", PROBE_EXIT="3")
    assert (warm.returncode, warm.stderr) == (real.returncode, real.stderr) == (3, "to stderr\n")
    seen, expected = said(warm), said(real)
    for key in ("argv", "cwd", "path0", "name", "x", "rank"):
        assert seen[key] == expected[key], key
    assert seen["argv"][1:] == ["a", "--b"] and seen["x"] == "given" and seen["name"] == "__main__"
    again = said(prewarmed.run([sys.executable, *form], env=dict(os.environ), timeout=60))
    assert again["random"] != seen["random"] and again["pid"] != seen["pid"]  # reseeded, a new process each


def test_an_uncaught_exception_is_a_traceback_and_status_1(probe):
    real, warm = both([sys.executable, "probe.py"], PROBE_FAIL="0")
    assert warm.returncode == real.returncode == 1
    assert warm.stderr.splitlines()[-1] == real.stderr.splitlines()[-1] == "ValueError: probe failed"


def test_ranks_get_torchruns_variables_and_a_failed_rank_ends_the_others(probe):
    cmd = [*prewarmed.TORCHRUN, "2", "probe.py"]
    ranks = [json.loads(line) for line in prewarmed.run(cmd, env=dict(os.environ), timeout=60).stdout.splitlines()]
    assert sorted((r["rank"], r["world"]) for r in ranks) == [("0", "2"), ("1", "2")]
    started = time.monotonic()
    failed = prewarmed.run(cmd, env=dict(os.environ, PROBE_FAIL="1", PROBE_SLEEP="60"), timeout=60)
    assert failed.returncode == 1 and "ValueError: probe failed" in failed.stderr
    assert time.monotonic() - started < 30  # rank 0's sleep was ended, not waited for


def test_a_timeout_ends_the_program_and_raises_as_subprocess_does(probe):
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        prewarmed.run([sys.executable, "probe.py"], env=dict(os.environ, PROBE_SLEEP="60"), timeout=2)
    pid = json.loads(expired.value.output.decode().splitlines()[0])["pid"]
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")


def test_other_commands_and_prewarm_off_run_for_real(probe, monkeypatch):
    assert prewarmed.run(["bash", "-c", "echo $$"], env=dict(os.environ), timeout=60).stdout.strip().isdigit()
    monkeypatch.setenv(prewarmed.ENABLE, "0")
    real = prewarmed.run([sys.executable, "probe.py"], env=dict(os.environ), timeout=60)
    assert said(real)["argv"] == ["probe.py"] and real.returncode == 0
