"""The run lifecycle on the emulated cluster (issue 23, items 1-3): two `fab train` at once give one run and
one refusal; a stop is `stopped` and resumable; a resume with a conflicting flag is one line and leaves
the run's state as it was. Run one at a time: `flock /tmp/emulated-cluster.lock pytest -k ...`."""

from __future__ import annotations

import os
import subprocess

import pytest
from cluster_harness import QUICK, start_cluster, stop_cluster
from conftest import REPO

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    cluster = start_cluster("tl2", 2, "10.213.140.0/24", tmp_path_factory.mktemp("tl2"))
    yield cluster
    stop_cluster(cluster)


def test_two_trains_at_once_then_stop_and_a_refused_resume(two):
    args = ["fab", "train", "--run", "race", "--steps", "2000", "--extra", QUICK]
    both = [
        subprocess.Popen(args, cwd=REPO, env=two.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in both]
    codes = sorted(p.returncode for p in both)
    assert codes == [0, 1], outs
    refusal = next(err for (out, err), p in zip(outs, both) if p.returncode == 1).strip().splitlines()
    assert len(refusal) == 1 and "a run is already going in" in refusal[0], refusal
    two.wait_for_step("race", 10)
    stopped = two.fab("stop", "--run", "race").stdout
    assert "resumable: `fab train --run race`" in stopped, stopped
    assert two.run_status("race")["state"] == "stopped"
    before = (two.run_dir("race") / "run-status.json").read_text()
    refused = two.fab("train", "--run", "race", "--batch-per-gpu", "3", check=False)
    assert refused.returncode == 1 and "differs from the run's" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert (two.run_dir("race") / "run-status.json").read_text() == before  # the run untouched
    runs = two.fab("runs").stdout
    assert "race" in runs and "stopped" in runs
