"""--follow's filter (clusterops.run.logfilter) on train.log as a lost node left it on the emulated cluster
(tests/data/lost-node-train.log, recorded before the fix: Open MPI's help text, two rank tracebacks)."""

from __future__ import annotations

from conftest import REPO

from clusterops.run.logfilter import FollowFilter

RECORDED = (REPO / "tests" / "data" / "lost-node-train.log").read_text()
HINT = "`fab logs --run lost`"


def _filtered(text: str, size: int) -> str:
    shown = FollowFilter(HINT)
    out = "".join(shown.feed(text[i : i + size]) for i in range(0, len(text), size))
    return out + shown.flush()


def test_follow_hides_open_mpi_help_and_rank_tracebacks_and_says_how_to_see_them():
    out = _filtered(RECORDED, 4096)
    assert "PATH and LD_LIBRARY_PATH" not in out and "Traceback" not in out and "[rank" not in out
    assert "closed by remote host" not in out and "GLHF" not in out
    assert "step 20/60 (33%)" in out and "watchdog: node 10.213.140.12 unreachable" in out
    notes = [line for line in out.splitlines() if "not shown here" in line]
    assert notes == [f"  (76 lines of Open MPI and rank error output not shown here: {HINT} prints them)"]
    assert len(out.splitlines()) == len(RECORDED.splitlines()) - 76 + 1


def test_chunks_cut_anywhere_give_the_same_lines():
    assert _filtered(RECORDED, 7) == _filtered(RECORDED, 100_000)


def test_a_help_frame_that_never_closes_ends_at_the_supervisors_next_line():
    text = "step 1\n" + "-" * 74 + "\nsome help\n2026-11-24T08:01:30Z launcher: mpirun exited with 1\nstep 2\n"
    out = _filtered(text, 5)
    assert out.splitlines()[-2:] == ["2026-11-24T08:01:30Z launcher: mpirun exited with 1", "step 2"]
    assert "some help" not in out


def test_open_mpis_harmless_setpgid_warning_is_not_shown_or_counted():
    """Issue 32 §11: every healthy --follow said "(1 line of Open MPI and rank error output not shown...)"
    for plm_rsh's setpgid warning (mca_plm_rsh.so: "plm:rsh: Warning: setpgid(%ld,%ld) failed in parent")."""
    log = (
        "settings: recipe transformer-tiny\n"
        "[node0:4242] plm:rsh: Warning: setpgid(4250,4250) failed in parent with errno=Permission denied(13)\n"
        "plm:rsh: Warning: setpgid(4251,4251) failed in parent with errno=Permission denied(13)\n"
        "step 1/60 (1%) | loss 7.2\n"
    )
    assert _filtered(log, 7) == "settings: recipe transformer-tiny\nstep 1/60 (1%) | loss 7.2\n"
