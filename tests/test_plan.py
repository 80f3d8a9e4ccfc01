"""`fab plan`'s model without a cluster: scaling at a fixed global batch, the ring all-reduce, GPU
speed factors (and the refusal from a CPU run), dollars, the deadline, and the eval curve's target."""

from dataclasses import replace

import pytest

from clusterops.predict import plan
from clusterops.predict.bottleneck import Breakdown, ring_wire_bytes

MB = 1e6


def base(world=1, gpu=plan.CPU, link=1.0, **overrides) -> plan.Base:
    values = dict(
        data=0.01,
        compute=0.60,
        exposed=0.0,
        optimizer=0.02,
        other=0.01,
        wire_bytes=ring_wire_bytes(100 * MB, world),
        grad_bytes=100 * MB,
        world_size=world,
        objects_per_step=64,
    )
    return plan.Base(Breakdown(**{**values, **overrides}), gpu, 1, link, "test run")


def offer(gpu=plan.CPU, price=1.0, link=1.0, gpus=1, name="t.x") -> plan.Offer:
    return plan.Offer(name, gpu, gpus, price, "given", link, "given")


def test_the_measured_configuration_predicts_the_measured_step():
    b = base(world=2, exposed=0.5)  # 0.8 s of wire at 1 Gbit/s, 0.3 s of it hidden
    step, _ = plan.step_at(b, 2, 1.0)
    assert step == pytest.approx(b.breakdown.step)


def test_more_ranks_split_the_global_batch_and_pay_the_ring():
    one = base(world=1)
    step, model = plan.step_at(one, 2, 1.0)
    # compute and data halve; the ring sends 2(2-1)/2 x 100 MB = 0.8 s at 1 Gbit/s, none hidden from a 1-rank run
    assert step == pytest.approx(0.005 + 0.30 + 0.8 + 0.02 + 0.01)
    assert "x 1/2" in model and "none hidden" in model
    three, _ = plan.step_at(one, 3, 10.0)
    assert three == pytest.approx(0.01 / 3 + 0.2 + ring_wire_bytes(100 * MB, 3) * 8 / 10e9 + 0.03)


def test_hidden_communication_is_capped_by_the_smaller_compute():
    b = base(world=2, exposed=0.1)  # 0.7 s of the 0.8 s hidden behind 0.6 s of compute: 0.6
    step, _ = plan.step_at(b, 4, 1.0)
    wire = ring_wire_bytes(100 * MB, 4) * 8 / 1e9  # 1.2 s
    compute = 0.6 * 2 / 4  # 0.3 s: hides at most 0.3 s
    assert step == pytest.approx(0.005 + compute + (wire - compute) + 0.03)


def test_an_all_reduce_slower_than_its_link_stays_as_slow():
    b = base(world=2, exposed=2.0, compute=0.1)  # 0.8 s of wire was seen as 2.0 s exposed: 2.5x
    step, model = plan.step_at(b, 2, 1.0)
    assert step == pytest.approx(b.breakdown.step)
    assert "measured" in model


def test_a_cpu_run_predicts_no_gpu_and_says_why():
    e = plan.estimate(base(), offer(gpu="A10G", name="g5.xlarge"), 2, 100, plan.Storage())
    assert e.step_s is None and e.usd_total is None
    assert "measured on CPU" in e.refused and "g5.xlarge" in e.refused


def test_another_gpu_scales_compute_by_its_peak_ratio():
    b = base(gpu="T4")
    e = plan.estimate(b, offer(gpu="A100"), 1, 100, plan.Storage())
    assert e.step_s == pytest.approx(0.01 + 0.60 * 65 / 312 + 0.03)
    assert "A100/T4" in dict(e.models)["step"]
    unknown = plan.estimate(b, offer(gpu="A10G"), 1, 100, plan.Storage())
    assert unknown.step_s is None and "A10G" in unknown.refused


def test_an_fp32_run_is_not_scaled_to_another_gpu_by_fp16_figures():
    """T4 fp32 (8.1 TFLOPS) to A100 TF32 (156) is ~19x, the FP16 ratio 4.8x: no upper bound, refused."""
    fp32 = replace(base(gpu="T4"), precision="fp32")
    e = plan.estimate(fp32, offer(gpu="A100"), 1, 100, plan.Storage())
    assert e.step_s is None and "computed in fp32" in e.refused and "--precision fp16 or bf16" in e.refused
    assert plan.estimate(fp32, offer(gpu="T4"), 1, 100, plan.Storage()).step_s is not None  # its own GPU


def test_dollars_are_nodes_storage_and_io_each_with_its_model():
    e = plan.estimate(base(), offer(price=2.0), 1, 6000, plan.Storage(root_gb=100, efs_gb=10, read_gb=50, write_gb=1))
    hours = 6000 * 0.64 / 3600
    assert e.hours == pytest.approx(hours)
    assert e.usd_nodes == pytest.approx(2.0 * hours)
    assert e.usd_storage == pytest.approx((100 * 0.08 + 10 * 0.3) * hours / 730)
    assert e.usd_io == pytest.approx(50 * 0.03 + 1 * 0.06)
    assert e.usd_total == pytest.approx(e.usd_nodes + e.usd_storage + e.usd_io)
    assert [name for name, _ in e.models] == ["step", "time", "nodes", "storage", "EFS I/O"]
    assert plan.estimate(base(), offer(price=None), 1, 10, plan.Storage()).usd_total is None


def test_the_cheapest_that_meets_the_deadline():
    b = base(world=1, compute=3.0)
    estimates = plan.plan(b, [offer(link=10.0)], 4, 3600, plan.Storage())
    fastest = min(estimates, key=lambda e: e.hours)
    assert plan.cheapest(estimates, None).nodes == 1  # no deadline: one node costs least
    assert plan.cheapest(estimates, 1.0).nodes == min(e.nodes for e in estimates if e.hours <= 1.0)
    assert plan.cheapest(estimates, fastest.hours / 2) is None
    rows = plan.table_rows(estimates, 1.0)
    assert {row["deadline"] for row in rows} == {"ok", "late"}


def test_a_lost_node_costs_the_snapshot_interval_or_without_snapshots_the_checkpoint_interval():
    """Issue 30: 2 nodes at $10/h each ($20/h): a minute of snapshots costs $0.33; with every node's memory
    lost, or snapshots off, the checkpoint bound: 100 steps (under 30 minutes here)."""
    e = plan.estimate(base(compute=6.0), offer(price=10.0, link=10.0), 2, 3600, plan.Storage())
    assert e.step_s is not None and 100 * e.step_s < 1800
    every = 100 * e.step_s
    intervals = plan.Intervals(snapshot_s=60, checkpoint_every=100, checkpoint_min=30)
    line = plan.node_loss(e, intervals)
    assert line.startswith("a lost node (--max-restarts): at most 60 s of steps, $0.33 (the snapshot interval)")
    checkpoints = f"{every / 60:.0f} min of steps, ${20 * every / 3600:.2f}"
    assert line.endswith(f"with every node's memory lost: {checkpoints} (checkpoints)"), line
    off = plan.node_loss(e, replace(intervals, snapshot_s=0))
    assert off == f"a lost node (--max-restarts): at most {checkpoints} (the checkpoint interval: --snapshot-seconds 0)"
    assert "at most 30 min of steps, $10.00" in plan.node_loss(e, plan.Intervals(snapshot_s=0))  # the time bound


LOG = """step 10/100 (10%) | loss 3.2 | ...
eval step 50 | eval_loss 2.100 | bleu 41.200
eval step 100 | eval_loss 1.500 | bleu 63.000
eval step 150 | eval_loss 1.400 | bleu 61.000
"""


def test_the_target_step_is_the_first_evaluation_that_reached_the_metric():
    curve = plan.eval_curve(LOG)
    assert curve[0] == (50, {"eval_loss": 2.1, "bleu": 41.2})
    assert plan.steps_to(curve, "bleu", 60)[0] == 100
    assert plan.steps_to(curve, "eval_loss", 1.45)[0] == 150  # a loss: at or below
    with pytest.raises(ValueError, match="never reached bleu 70 .best 63 at step 100"):
        plan.steps_to(curve, "bleu", 70)
    with pytest.raises(ValueError, match="no 'top1'"):
        plan.steps_to(curve, "top1", 0.8)
    assert plan.parse_metric("top1=80") == ("top1", 80.0) and plan.parse_metric("top1=0.8%") == ("top1", 0.8)
    # Issue 32 §4: top1=0.8, the help's own example, meant 0.8 %: top-1 is reported in percent.
    for text, words in (("top1=0.8", "top1=80 for 80%"), ("bleu=160", "at most 100"), ("eval_loss=-1", "negative")):
        with pytest.raises(ValueError, match=words):
            plan.parse_metric(text)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        plan.parse_metric("bleu>60")


def test_the_emulated_cluster_splits_the_machines_cpus_between_its_nodes():
    assert [plan.cpu_share(n, 2) for n in (1, 2, 3, 4)] == [2.0, 1.0, 2 / 3, 0.5]
    local = plan.Offer("local", plan.CPU, 1, None, "none", 10.0, "cap", machine_cpus=2)
    one, three = (plan.estimate(base(), local, n, 10, plan.Storage()) for n in (1, 3))
    assert one.step_s == pytest.approx(0.64)
    # 1/3 of the batch each, at a third of the CPU the 1-node run had (2/3 against 2)
    assert three.step_s == pytest.approx(0.01 / 3 + 0.6 / 3 * 3 + ring_wire_bytes(100 * MB, 3) * 8 / 10e9 + 0.03)


def test_plan_spot_prices_a_spot_clusters_own_type_where_its_nodes_run(monkeypatch):
    """`fab plan --spot` for the cluster's own type takes the Spot price `fab inventory` read in the nodes'
    AZ (the price fab cost and the budget meter use), not the region's cheapest AZ; other types are read."""
    from clusterops.inventory import Inventory, Node, SshSettings
    from clusterops.run import planner

    node = Node(0, "node0", "1.2.3.4", "10.0.0.1", "i-0")
    inv = Inventory("c", "aws", [node], 1, SshSettings("ubuntu", 4444, "k", "kh"), instance_type="g4dn.xlarge")
    inv = replace(inv, region="us-east-1", spot=True, usd_per_hour=0.2104, price_source="Spot in us-east-1b")
    monkeypatch.setattr(planner, "aws_session", lambda region: (_ for _ in ()).throw(AssertionError("AWS asked")))
    own = planner._offer(inv, "g4dn.xlarge", base(gpu="T4"), None, spot=True)
    assert (own.usd_per_hour, own.price_source) == (0.2104, "Spot in us-east-1b")
    with pytest.raises(AssertionError, match="AWS asked"):
        planner._offer(inv, "g5.xlarge", base(gpu="T4"), None, spot=True)
