"""`fab train --budget-usd`: the spend the supervisor meters (nodes x price x time, EFS I/O at a rate:
clusterops.cost's model), the STOP it writes when the spend reaches the budget, the final status that
says why; and the laptop's refusal when `fab plan` predicts more than the budget and its margin."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import test_launch
from supervisor_fixture import write_spec
from test_supervisor import HEALTHY, NOW, FakeMpirun, FakeNodes, Script

from cluster_node.protocol import rundir, spec
from cluster_node.protocol.rundir import Summary
from cluster_node.supervisor.budget import Meter, Spend
from cluster_node.supervisor.loop import Supervisor
from cluster_node.supervisor.observe import Observation
from clusterops.cost import Price
from clusterops.predict import plan as planning
from clusterops.predict.bottleneck import Breakdown
from clusterops.run import budget as budgets
from clusterops.run import launch, resume

BUDGET = spec.Budget(usd=10.0, usd_per_node_hour=3600.0, io_usd_per_hour=360.0, source="the test's price table")


def test_the_budget_travels_in_the_run_spec(tmp_path):
    run_spec = write_spec(tmp_path, ["train.py"], ["h1", "h2"])
    with_budget = spec.RunSpec(**{**run_spec.__dict__, "budget": BUDGET})
    spec.write(tmp_path, with_budget)
    assert spec.read(tmp_path).budget == BUDGET


def test_the_meter_prices_nodes_by_the_second_and_efs_io_at_its_rate():
    meter = Meter(BUDGET, start=NOW)
    meter.add(nodes=2, now=NOW + 2)  # 2 nodes x 2 s at $1/s + 2 s at $0.1/s
    assert meter.nodes_usd == pytest.approx(4.0) and meter.io_usd == pytest.approx(0.2) and not meter.reached
    meter.add(nodes=1, now=NOW + 8)  # a restart on one node: 6 s more at $1/s
    assert meter.spent == pytest.approx(10.8) and meter.reached
    line = meter.line(step=42)
    assert line.startswith("budget: $10.00 reached at step 42 ($10.80 spent: nodes $10.00")
    assert "EFS I/O $0.80" in line and "the test's price table" in line


def _supervisor(tmp_path, exits, clock, budget=BUDGET, restarts=0):
    run_spec = write_spec(tmp_path, ["train.py"], ["h1", "h2"], max_restarts=restarts)
    run_spec = spec.RunSpec(**{**run_spec.__dict__, "budget": budget})
    (tmp_path / "active").write_text(f"{tmp_path}\n")
    (tmp_path / "checkpoints").mkdir()
    mpirun = FakeMpirun(exits)
    return Supervisor(tmp_path, run_spec, mpirun, FakeNodes(tmp_path), clock=clock, observer=Script()), mpirun


def test_a_run_that_reaches_its_budget_is_asked_to_checkpoint_and_ends_saying_why(tmp_path):
    now = [NOW]  # the supervisor's clock, set before each poll (how often it reads it is its business)
    sup, mpirun = _supervisor(tmp_path, [None, None, 0], lambda: now[0])
    (tmp_path / "progress.json").write_text(json.dumps({"step": 17, "max_steps": 1000}))
    sup.launch()
    now[0] = NOW + 3
    sup.apply(sup.decide(Observation(NOW + 3, first_step=True)))
    assert not (tmp_path / "STOP").exists()  # $6.30 of $10
    now[0] = NOW + 6
    sup.apply(sup.decide(Observation(NOW + 6, first_step=True)))
    stop = (tmp_path / "STOP").read_text()
    assert stop.startswith("now: budget: $10.00 reached at step 17 ($12.60 spent")  # checkpoint, no eval
    (tmp_path / "checkpoints" / "step_00000018.pt").write_bytes(b"x")
    with open(tmp_path / "train.log", "a") as log:
        log.write("run ended at step 18: stop requested\n")
    now[0] = NOW + 9
    sup.apply(sup.decide(Observation(NOW + 9, exited=0)))
    sup.finish()
    status = json.loads((tmp_path / "run-status.json").read_text())
    assert status["state"] == "finished" and status["kind"] == "budget"
    assert status["reason"].startswith("budget: $10.00 reached at step 17 ($12.60 spent: nodes $12.00")
    assert status["reason"].endswith("; checkpoint step 18")
    assert "launcher: budget: $10.00 reached at step 17" in (tmp_path / "train.log").read_text()


def _base(step_s: float = 1.0) -> planning.Base:
    b = Breakdown(0.0, step_s, 0.0, 0.0, 0.0, 0.0, 0.0, 1, 1.0)
    return planning.Base(b, planning.CPU, 1, None, "run base: 1 rank")


OFFER = planning.Offer("local", planning.CPU, 1, 3600.0, "the test's price table", 1.0, "given", 0)


def test_a_prediction_over_budget_and_margin_is_refused_in_one_line():
    estimate = planning.estimate(_base(), OFFER, 1, 100, planning.Storage(root_gb=0))
    refusal = budgets.refusal(estimate, 100, budget_usd=50.0, margin=0.2)
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith("fab plan predicts $100.00 for 100 steps on 1 x local")
    assert "(1.7 min at 1000 ms/step" in refusal and "--budget-usd 50 " in refusal and "--budget-margin 1.00" in refusal
    assert budgets.refusal(estimate, 100, budget_usd=90.0, margin=0.2) is None  # within the margin: the meter decides


def test_an_unknown_price_refuses_a_budget():
    with pytest.raises(budgets.BudgetError, match="no price known"):
        budgets.run_budget(5.0, None, "unknown: not in the offline table", 0.0)
    # The new-user walk: on the emulated cluster, "run `fab inventory`" led to "no cdk-outputs.json".
    with pytest.raises(budgets.BudgetError, match="the emulated cluster bills nothing.*usd_per_hour") as refused:
        budgets.run_budget(5.0, None, "local is not in the offline table", 0.0, emulated=True)
    assert "fab inventory" not in str(refused.value)


MB = 1e6
PARTS = {"data_s": 0.01, "compute_s": 0.5, "comm_exposed_s": 0.05, "optimizer_s": 0.02, "other_s": 0.02}
MEASURED = Summary(  # a run on 2 nodes x 4 ranks (-c gpus_per_node=4 on 8-GPU p4d nodes)
    recipe="transformer-base",
    steps=100,
    world_size=8,
    global_batch=256,
    breakdown={**PARTS, "wire_bytes": 175 * MB, "grad_bytes": 100 * MB, "buckets": 4},
)


def test_the_prediction_places_the_inventorys_ranks_per_node_not_the_instance_types_gpus():
    """fab plan's base has inventory.gpus_per_node ranks per node (fabfile/analysis.py _plan_base): on the same
    2 nodes the measured run's own step comes back, not the step of 16 ranks."""
    estimate = budgets.prediction(
        {"summary": MEASURED, "link": (100.0, "given")}, "p4d.24xlarge", True, 2, 100, 21.96, "table", gpus_per_node=4
    )
    assert estimate.step_s == pytest.approx(sum(PARTS.values()))


def test_a_launch_on_more_ranks_is_priced_for_the_batch_it_trains():
    """The base ran 8 ranks at 32 a rank (a global batch of 256); a launch on 4 nodes x 4 at the same 32
    steps 512: each rank computes what it did in the base run, and the all-reduce, the optimizer and the
    rest count once a step. Before: priced at the base's 256 split over 16 ranks, half the work a step."""
    inputs = {"summary": MEASURED, "link": (100.0, "given"), "config": {"batch_per_gpu": 32, "batching": "sentences"}}
    split = budgets.prediction(inputs, "p4d.24xlarge", True, 4, 100, 21.96, "table", 4, ("objects", 16))
    same = budgets.prediction(inputs, "p4d.24xlarge", True, 4, 100, 21.96, "table", 4, ("objects", 32))
    assert split.step_s == pytest.approx(budgets.prediction(inputs, "p4d.24xlarge", True, 4, 100, 21.96, "t", 4).step_s)
    assert same.step_s - split.step_s == pytest.approx((PARTS["data_s"] + PARTS["compute_s"]) / 2)
    assert "x 2 (the global batch)" in dict(same.models)["step"] and "100 steps" in dict(same.models)["time"]
    tokens = {**inputs, "config": {"batch_per_gpu": 32, "batching": "tokens", "max_tokens": 4096}}
    with pytest.raises(planning.PlanError, match="sized by a --max-tokens budget, this launch's by --batch-per-gpu"):
        budgets.prediction(tokens, "p4d.24xlarge", True, 4, 100, 21.96, "table", 4, ("objects", 32))
    assert budgets.rank_batch({"batching": "tokens", "max_tokens": 4096, "grad_accum": 2}) == ("tokens", 8192)
    image = {"recipe": "resnet50", "batching": "tokens", "max_tokens": 4096, "batch_per_gpu": 256}  # ignored there
    assert budgets.rank_batch(image) == ("objects", 256)


def test_a_budget_is_not_predicted_from_a_run_of_another_recipe(monkeypatch):
    """Before: a resnet50 launch after a transformer smoke run was priced at the transformer's step."""
    from clusterops.run import analysis, lifecycle, trainlaunch

    inv = dataclasses.replace(test_launch.inventory(nodes=2, gpus=4), instance_type="p4d.24xlarge")
    inputs = {"summary": MEASURED, "link": (100.0, "given"), "config": {"batch_per_gpu": 32}}
    monkeypatch.setattr(analysis, "plan_inputs", lambda *args: inputs)
    monkeypatch.setattr(lifecycle, "latest_run", lambda *args: "/data/runs/smoke")
    price = Price(21.96, "table")
    for recipe, priced in (("resnet50", False), ("transformer-base", True)):
        plan = launch.LaunchPlan(launch.TrainRequest(recipe=recipe, run="new"), tuple(inv.nodes), "ens5", "/w")
        estimate, why = trainlaunch._prediction(None, inv, plan, budgets.Trains(100, ("objects", 32), recipe), price, 2)
        assert (estimate is not None) == priced, why
        assert priced or why == "run smoke trained transformer-base, not resnet50"


def _notice(host: str, noticed: float, action: float) -> dict:
    iso = "%Y-%m-%dT%H:%M:%SZ"
    return rundir.Interruption(
        node=1,
        instance_id=f"i-{host}",
        host=host,
        action="stop",
        action_time=time.strftime(iso, time.gmtime(action)),
        noticed=time.strftime(iso, time.gmtime(noticed)),
    ).to_json()


def test_the_meter_counts_every_node_of_the_cluster_not_the_attempts_less_a_reclaimed_spot_node(tmp_path):
    """2 of the cluster's 4 nodes run the attempt (--nodes 2, or a restart left 2 out): all 4 bill, as
    `fab cost` prices them, until EC2 takes a Spot node away at its notice's action time."""
    now = [NOW]
    sup, _ = _supervisor(tmp_path, [None], lambda: now[0], budget=dataclasses.replace(BUDGET, usd=1000.0, nodes=4))
    sup.launch()
    now[0] = NOW + 2
    sup.decide(Observation(NOW + 2, first_step=True))
    assert sup.meter is not None and sup.meter.nodes_usd == pytest.approx(8.0)  # 4 nodes x 2 s x $1/s
    (tmp_path / "interruptions.json").write_text(json.dumps([_notice("h9", NOW + 2, NOW + 4)]))
    now[0] = NOW + 4
    sup.decide(Observation(NOW + 4, first_step=True))
    now[0] = NOW + 6
    sup.decide(Observation(NOW + 6, first_step=True))
    assert sup.meter.nodes_usd == pytest.approx(8.0 + 8.0 + 6.0)  # 4 nodes to the action, 3 after it
    saved = rundir.read_record(tmp_path / rundir.BUDGET, Spend)
    assert saved is not None and saved.nodes == 3 and saved.spent == pytest.approx(22.0 + 0.6)


def test_a_notice_from_an_earlier_segment_does_not_take_a_node_away(tmp_path):
    """A Spot node stopped in an earlier segment of the run is back (EC2 restarted it, or the resume waited)."""
    (tmp_path / "interruptions.json").write_text(json.dumps([_notice("h9", NOW - 600, NOW - 480)]))
    meter = Meter(dataclasses.replace(BUDGET, nodes=4), start=NOW)
    assert meter.billing(tmp_path, NOW + 10) == 4


def test_a_resumed_run_meters_on_top_of_what_its_earlier_segments_spent(tmp_path):
    meter = Meter(dataclasses.replace(BUDGET, nodes=2, spent=9.0), start=NOW)
    assert meter.check(tmp_path, NOW + 1, print).startswith("budget: $10.00 reached at step none yet ($11.10 spent: ")
    assert "earlier segments $9.00, nodes $2.00" in meter.stopped
    # io_to: the launch-time rate (no file system here) counts to the reading, nothing left for the next segment
    expected = Spend(usd=10.0, spent=11.1, time=NOW + 1, nodes=2, io_to=NOW + 1, io_estimate=0.0)
    assert rundir.read_record(tmp_path / rundir.BUDGET, Spend) == expected


def test_a_budget_stop_that_lands_during_a_restart_keeps_the_budgets_line_and_kind(tmp_path):
    """The meter wrote the STOP; the attempt died before honouring it (row 10), so the supervisor was
    restarting when it saw the STOP (row 13): the end is the budget's, resumable."""
    now = [NOW]
    sup, mpirun = _supervisor(tmp_path, [None, 1], lambda: now[0], restarts=1)
    (tmp_path / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1}))
    (tmp_path / "checkpoints" / "step_00000030.pt").write_bytes(b"x")
    (tmp_path / "probes").mkdir()
    for host in ("h1", "h2"):
        (tmp_path / "probes" / host).write_text(HEALTHY)
    sup.launch()
    now[0] = NOW + 6
    sup.apply(sup.decide(Observation(NOW + 6, first_step=True)))
    assert (tmp_path / "STOP").exists()
    sup.apply(sup.decide(Observation(NOW + 7, exited=1)))
    assert sup.state.value == "restarting" and sup.kind == "died"
    sup.step()
    sup.finish()
    status = json.loads((tmp_path / "run-status.json").read_text())
    assert status["kind"] == "budget" and status["state"] == "stopped", status
    assert status["reason"].startswith("budget: $10.00 reached at step none yet ($12.60 spent")
    assert "; stopped during a restart at checkpoint 30 (" in status["reason"]
    assert len(mpirun.starts) == 1  # no relaunch


def test_a_budget_stops_the_nodes_when_the_run_ends_unless_keep_nodes():
    """A budget stop with the nodes left up bills the idle watchdog's hour (2 x p4d.24xlarge: ~$44 after a $5
    budget): --budget-usd implies --then-stop; --keep-nodes keeps them up."""
    inv = test_launch.inventory()
    budgeted = launch.train_spec(inv, launch.TrainRequest(budget_usd=5.0), "ens5", inv.code_dir)
    assert budgeted.then_stop is not None and "--stop-now" in budgeted.then_stop.argv
    kept = launch.train_spec(inv, launch.TrainRequest(budget_usd=5.0, keep_nodes=True), "ens5", inv.code_dir)
    assert kept.then_stop is None
    assert launch.train_spec(inv, launch.TrainRequest(), "ens5", inv.code_dir).then_stop is None


def test_the_budget_line_says_how_many_nodes_it_meters_and_whether_they_stop():
    budget = budgets.run_budget(5.0, 21.96, "table", 0.0, nodes=3, spent=1.25)
    line = budgets.budget_line(launch.TrainRequest(budget_usd=5.0), budget, "fab plan predicts $2.00 for 10 steps")
    assert line.startswith("budget: $5 ($1.25 of it spent by the run's earlier segments), metered over 3 node(s)")
    assert "fab plan predicts $2.00 for 10 steps" in line and "the nodes stop when the run ends" in line
    kept = budgets.budget_line(launch.TrainRequest(budget_usd=5.0, keep_nodes=True), budget, "no prediction")
    assert "--keep-nodes: the nodes stay up after the run" in kept and "\n" not in kept


SAVED_RUN = resume.Saved(
    config={"recipe": "transformer-tiny", "data": "/data/datasets/numbers", "max_steps": 1000},
    spec=None,
    budget=Spend(usd=6.0, spent=4.5, time=NOW),
    step=700,
)


def test_a_resumed_run_keeps_its_saved_budget_and_predicts_the_steps_left():
    """The steps to price are check_trainer's (the saved max_steps, or --steps); a resume trains what is left."""
    inv = test_launch.inventory()
    request = resume.resumed(launch.TrainRequest(run="r"), set(), SAVED_RUN, inv)
    assert request.budget_usd == 6.0
    assert budgets.steps_to_run(1000, SAVED_RUN) == (300, "the 300 steps left (1000 - checkpoint 700)")
    given = resume.resumed(launch.TrainRequest(run="r", budget_usd=20.0, steps=2000), {"budget_usd"}, SAVED_RUN, inv)
    assert given.budget_usd == 20.0  # a new limit; the spend stays the run's
    assert budgets.steps_to_run(2000, SAVED_RUN)[0] == 1300  # check_trainer's: --steps
    assert budgets.spent_before(SAVED_RUN) == 4.5 and budgets.spent_before(None) == 0.0


def test_a_resume_whose_spend_already_reached_its_budget_is_refused_before_it_starts():
    estimate = planning.estimate(_base(), OFFER, 1, 1, planning.Storage(root_gb=0))  # $1
    refusal = budgets.refusal(estimate, 1, budget_usd=6.0, margin=0.2, spent=6.2)
    assert refusal is not None and refusal.startswith("run already spent $6.20 of its --budget-usd 6: ")
    assert "--budget-usd" in refusal and "\n" not in refusal
    assert budgets.refusal(estimate, 1, budget_usd=6.0, margin=0.2, spent=4.5) is None  # $1 of the $1.50 left
    assert budgets.refusal(estimate, 1, budget_usd=6.0, margin=0.0, spent=5.5) is not None  # $1 over $0.50


def test_the_prediction_prices_every_node_of_the_cluster_for_the_time_the_runs_nodes_take():
    estimate = planning.estimate(_base(), OFFER, 1, 100, planning.Storage(root_gb=0))  # 1 node, $100
    three = budgets.billed(estimate, 3)
    assert three.usd_nodes == pytest.approx(300.0) and three.hours == estimate.hours
    assert budgets.billed(estimate, 1) == estimate
