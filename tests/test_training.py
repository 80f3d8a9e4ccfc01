"""The training program on CPU with gloo, real processes (torchrun), real data (prepare.py numbers)."""

import json
import re
import subprocess
import sys

import prewarmed
import pytest
import torch
from conftest import REPO, TRAIN_DIR, tool_env

from cluster_node.protocol import phases, rundir
from train import checkpoint, strict_device
from train.recipes import transformer_lr

SMALL = [
    "--recipe",
    "transformer-tiny",
    "--dropout",
    "0",
    "--d-model",
    "64",
    "--ffn",
    "128",
    "--eval-samples",
    "16",
    "--log-every",
    "1",
    "--checkpoint-every",
    "1000",
    "--warmup-steps",
    "50",
]


TORCHRUN = prewarmed.TORCHRUN


def train(data, run_dir, *args, procs=1, check=True, strict=True):
    """train.py alone, or under torchrun with `procs` ranks in strict-device mode (strict_device.py):
    a collective given a tensor made without device= fails the run, as NCCL would on GPUs. Forked from
    the pre-imported interpreter (prewarmed.py), or started for real with GPU_CLUSTER_TEST_PREWARM=0."""
    launcher = [*TORCHRUN, str(procs)] if procs > 1 else [sys.executable]
    strict_env = {strict_device.ENV: "1"} if procs > 1 and strict else {}
    result = prewarmed.run(
        [*launcher, "-m", "train.train", "--data", str(data), "--run-dir", str(run_dir), *SMALL, *args],
        timeout=300,
        env=tool_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **strict_env),
    )
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def losses(output: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/\d+ \(\d+%\) \| loss (\S+)", output)}


def final_params(run_dir) -> dict:
    return checkpoint.load_latest(run_dir)["model"]


def initial_params(run_dir) -> dict:
    """The weights before step 1: the trainer seeds with config.seed before building the model."""
    from train.config import ModelConfig
    from train.model import Transformer

    state = checkpoint.load_latest(run_dir)
    torch.manual_seed(state["config"]["seed"])
    vocab = state["model"]["embed.weight"].shape[0]
    return Transformer(ModelConfig(**state["config"]["model"]), vocab).state_dict()


def relative_diff(a: dict, b: dict, init: dict) -> float:
    """|a - b| over how far training moved the weights (|b - init|), across all parameters."""
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt()
    moved = sum(((b[k] - init[k]) ** 2).sum() for k in a).sqrt()
    return (diff / moved).item()


# Adam's first steps move a parameter by ~lr * g/(|g|+eps) whatever |g| is; with the published eps
# (1e-9) the float noise on exactly-zero gradients (attention key biases) becomes lr-sized steps.
EQUIVALENCE = ["--max-steps", "4", "--adam-eps", "1e-6", "--batching", "tokens"]


@pytest.fixture(scope="module")
def single_reference(numbers_data, tmp_path_factory):
    """One process taking both ranks' token buckets of every step as two micro-batches (sampler.py:
    a step's buckets depend on world size x accumulation only)."""
    run = tmp_path_factory.mktemp("single")
    train(numbers_data, run, *EQUIVALENCE, "--batch-per-gpu", "8", "--grad-accum", "2")
    return final_params(run), initial_params(run)


@pytest.mark.parametrize("compression, bound", [("none", 2e-5), ("fp16", 1e-2), ("bf16", 5e-2), ("powersgd", 0.5)])
def test_two_ranks_with_batch_b_match_one_process_with_batch_2b(
    numbers_data, tmp_path, single_reference, compression, bound
):
    result = train(
        numbers_data, tmp_path, *EQUIVALENCE, "--batch-per-gpu", "8", "--grad-compression", compression, procs=2
    )
    assert "2 process(es) via torchrun" in result.stdout
    reference, init = single_reference
    diff = relative_diff(final_params(tmp_path), reference, init)
    print(f"{compression}: parameter difference / parameter change = {diff:.2e}")
    assert diff < bound, f"{compression}: relative parameter difference {diff:.2e} >= {bound}"
    if compression != "none":
        assert diff > 1e-5, "a lossy compression that changes nothing was not applied"


def test_stop_and_resume_gives_the_same_losses_as_an_uninterrupted_run(numbers_data, tmp_path):
    """Token buckets: the resume at step 6 is in the middle of epoch 0 (about 700 steps of
    batch 8 in 6,000 pairs; test_text_batches checks the sampler across an epoch boundary). The split
    run warms batch shapes before its steps (a GPU's default): that changes no loss and no weight."""
    tokens = ["--batch-per-gpu", "8", "--dropout", "0.1", "--batching", "tokens"]
    whole = train(numbers_data, tmp_path / "whole", "--max-steps", "12", *tokens)
    first = train(numbers_data, tmp_path / "split", "--max-steps", "6", *tokens, "--warm-shapes", "3")
    second = train(numbers_data, tmp_path / "split", "--max-steps", "12", *tokens, "--warm-shapes", "5")
    assert "resuming from" in second.stdout and "at step 6" in second.stdout
    assert "warmed 3 batch shapes in" in first.stdout and "each run once before step 1)" in first.stdout
    assert "warmed 5 batch shapes in" in second.stdout and "each run once before step 7)" in second.stdout
    summary = json.loads((tmp_path / "split" / rundir.SUMMARY).read_text())
    assert summary["warmup"]["shapes_warmed"] == 5 and summary["warmup"]["shape_warm_s"] > 0
    warmed = [m for m in phases.read(tmp_path / "split") if m.event == "warm_shapes"]
    assert [m.step for m in warmed] == [0, 6] and all(m.end >= m.time for m in warmed)  # goodput's warm-up
    assert "warmed" not in whole.stdout  # none on a CPU by default
    assert re.search(r"batches: up to \d+ tokens per micro-batch .*; (\d{3}) batches in epoch 0", first.stdout)
    split = {**losses(first.stdout), **losses(second.stdout)}
    assert split == losses(whole.stdout) and len(split) == 12
    a, b = final_params(tmp_path / "whole"), final_params(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "stop_text, evaluated", [("", False), ("now: spot notice for node1", False)], ids=["fab-stop", "spot-notice"]
)
def test_stop_checkpoints_at_the_next_step_and_a_now_stop_skips_the_eval(numbers_data, tmp_path, stop_text, evaluated):
    """Two ranks: only rank 0 reads STOP, so "skip the eval" must reach rank 1 too (eval is collective).
    Issue 32 §9: `fab stop` waited 26.5 s for an eval first (a longer one could outlast its 120 s): no eval."""
    (tmp_path / "STOP").write_text(stop_text)
    result = train(numbers_data, tmp_path, "--max-steps", "50", "--batch-per-gpu", "4", procs=2)
    assert "run ended at step 1: stop requested" in result.stdout
    assert [p.name for p in checkpoint.list_steps(tmp_path)] == ["step_00000001.pt"]
    assert ("eval step 1" in result.stdout) is evaluated and not (tmp_path / "STOP").exists()
    assert ("(checkpoint now, no eval)" in result.stdout) is not evaluated
    progress = rundir.read_record(tmp_path / rundir.PROGRESS, rundir.Progress)
    summary = rundir.read_record(tmp_path / rundir.SUMMARY, rundir.Summary)
    assert progress and summary and (progress.ended_by, summary.ended_by) == ("stop", "stop")  # the supervisor reads it


def test_a_truncated_newest_checkpoint_is_skipped_with_a_message(numbers_data, tmp_path):
    train(numbers_data, tmp_path, "--max-steps", "4", "--batch-per-gpu", "4", "--checkpoint-every", "2")
    steps = checkpoint.list_steps(tmp_path)
    assert [p.name for p in steps][-2:] == ["step_00000002.pt", "step_00000004.pt"]
    steps[-1].write_bytes(steps[-1].read_bytes()[:1000])  # a crash mid-copy
    result = train(numbers_data, tmp_path, "--max-steps", "5", "--batch-per-gpu", "4", "--checkpoint-every", "2")
    assert "skipping unreadable checkpoint step_00000004.pt" in result.stdout
    assert "resuming from" in result.stdout and "at step 2" in result.stdout


def test_ranks_resume_from_the_checkpoint_rank_0_chose_even_when_their_listing_lags(numbers_data, tmp_path):
    train(numbers_data, tmp_path, "--max-steps", "4", "--batch-per-gpu", "4", "--checkpoint-every", "2", procs=2)
    assert [p.name for p in checkpoint.list_steps(tmp_path)][-2:] == ["step_00000002.pt", "step_00000004.pt"]
    result = prewarmed.run(
        [
            *TORCHRUN,
            "2",
            str(REPO / "tests" / "resume_worker.py"),
            "--recipe",
            "transformer-tiny",
            "--data",
            str(numbers_data),
            "--run-dir",
            str(tmp_path),
            *SMALL[2:],
            "--batch-per-gpu",
            "4",
        ],
        timeout=300,
        env=tool_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(r["step"] == 4 and r["path"].endswith("step_00000004.pt") for r in ranks), ranks


def test_checkpoints_are_atomic_keep_the_last_k_and_hold_what_resume_needs(tmp_path):
    for step in range(1, 6):
        checkpoint.save(tmp_path, step, {"step": step, "model": {}}, keep=3, best=(step == 2))
    (checkpoint.checkpoint_dir(tmp_path) / ".step_00000009.pt.tmp.123").write_bytes(b"partial")
    checkpoint.save(tmp_path, 6, {"step": 6, "model": {}}, keep=3)
    names = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir())
    assert names == ["best.pt", "step_00000004.pt", "step_00000005.pt", "step_00000006.pt"]
    assert checkpoint.load_file(checkpoint.checkpoint_dir(tmp_path) / "best.pt")["step"] == 2


def test_checkpoint_content(numbers_data, tmp_path):
    train(numbers_data, tmp_path, "--max-steps", "2", "--batch-per-gpu", "4", "--precision", "bf16")
    state = checkpoint.load_latest(tmp_path)
    assert {"model", "optimizer", "scheduler", "scaler", "step", "config", "vocabulary", "rng"} <= set(state)
    assert state["config"]["precision"] == "bf16" and state["vocabulary"].endswith("spm.model")
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "world_size", "avg_step_time_s", "objects_per_s", "eval_loss", "bleu", "checkpoint_mb"):
        assert summary[key] is not None, key
    assert (tmp_path / "eval" / "step_00000002.hypotheses.txt").exists()
    assert list((tmp_path / "tensorboard").iterdir())


def test_lr_schedule_equals_the_formula():
    d_model, warmup, scale = 512, 8000, 2.0
    for step in (1, 100, 4000, 8000, 8001, 50_000):
        expected = scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert transformer_lr(step, d_model, warmup, scale) == pytest.approx(expected, rel=1e-12)
    peak = max(range(1, 20_000, 7), key=lambda s: transformer_lr(s, d_model, warmup, scale))
    assert abs(peak - warmup) <= 7


def test_the_scheduler_in_the_trainer_follows_the_formula(numbers_data, tmp_path):
    result = train(numbers_data, tmp_path, "--max-steps", "3", "--batch-per-gpu", "2", "--lr-scale", "1.5")
    for step, lr in re.findall(r"step (\d+)/3 \(\d+%\) \| loss \S+ \| lr (\S+)", result.stdout):
        # after step N the scheduler holds the rate for step N+1
        assert float(lr) == pytest.approx(transformer_lr(int(step) + 1, 64, 50, 1.5), rel=1e-2)


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--precision", "fp8"], "--precision"),
        (["--grad-compression", "zip"], "--grad-compression"),
        (["--max-steps", "0"], "--max-steps"),
        (["--d-model", "100", "--heads", "8"], "--d-model"),
        (["--dropout", "1.5"], "--dropout"),
        (["--batch-per-gpu", "-1"], "--batch-per-gpu"),
        (["--label-smoothing", "1"], "--label-smoothing"),
        (["--eval-every", "0"], "--eval-every"),
    ],
)
def test_bad_configs_are_rejected_in_one_line(numbers_data, tmp_path, args, flag):
    result = train(numbers_data, tmp_path, *args, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: invalid {flag} ")
    assert not (tmp_path / "checkpoints").exists()


def test_missing_data_says_how_to_prepare_it(tmp_path):
    result = train(tmp_path / "nothing", tmp_path / "run", check=False)
    assert result.returncode == 2 and "python -m train.prepare numbers --out" in result.stderr


def test_gradient_accumulation_equals_the_larger_batch(numbers_data, tmp_path):
    """In sentences (token buckets of a larger budget are other buckets: a fixed batch is what
    accumulation must reproduce)."""
    train(numbers_data, tmp_path / "large", *EQUIVALENCE, "--batching", "sentences", "--batch-per-gpu", "16")
    train(
        numbers_data,
        tmp_path / "accum",
        *EQUIVALENCE,
        "--batching",
        "sentences",
        "--batch-per-gpu",
        "8",
        "--grad-accum",
        "2",
    )
    init = initial_params(tmp_path / "large")
    assert relative_diff(final_params(tmp_path / "accum"), final_params(tmp_path / "large"), init) < 2e-5


def test_fp16_autocast_with_grad_scaler_trains(numbers_data, tmp_path):
    train(numbers_data, tmp_path, "--max-steps", "3", "--batch-per-gpu", "4", "--precision", "fp16")
    state = checkpoint.load_latest(tmp_path)
    assert state["config"]["precision"] == "fp16" and state["scaler"]["scale"] > 0
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_beam_search_of_width_one_is_greedy_and_wider_beams_decode(numbers_data):
    from train.config import ModelConfig
    from train.data import DataSet
    from train.model import Transformer

    data = DataSet(numbers_data, 64)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(d_model=32, layers=1, heads=2, ffn=64, dropout=0.0, max_len=64), data.tokenizer.vocab_size
    ).eval()
    pairs, _, _ = data.split("valid")
    src = pairs.batch(range(4))[0]
    assert model.beam_search(src, 20, beam=1) == model.greedy(src, 20)
    wide = model.beam_search(src, 20, beam=4)
    assert len(wide) == 4 and all(isinstance(t, int) for row in wide for t in row)
    assert all(3 not in row for row in wide)  # EOS ends a hypothesis and is stripped


def test_weights_and_biases_logs_when_a_key_is_configured(numbers_data, tmp_path):
    result = prewarmed.run(
        [
            sys.executable,
            "-m",
            "train.train",
            "--data",
            str(numbers_data),
            "--run-dir",
            str(tmp_path),
            *SMALL,
            "--max-steps",
            "2",
            "--batch-per-gpu",
            "4",
        ],
        timeout=300,
        env=tool_env(WANDB_API_KEY="x" * 40, WANDB_MODE="offline", WANDB_SILENT="true"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    without = prewarmed.run(
        [
            sys.executable,
            "-m",
            "train.train",
            "--data",
            str(numbers_data),
            "--run-dir",
            str(tmp_path / "plain"),
            *SMALL,
            "--max-steps",
            "1",
            "--batch-per-gpu",
            "4",
        ],
        timeout=300,
        env=tool_env(WANDB_API_KEY=""),
    )
    assert without.returncode == 0 and not (tmp_path / "plain" / "wandb").exists()


def test_a_resumed_run_keeps_its_saved_settings_and_refuses_a_different_one(numbers_data, tmp_path):
    first = train(numbers_data, tmp_path, "--max-steps", "3", "--grad-compression", "fp16", "--lr-scale", "0.5")
    assert "gradient compression fp16, lr scale 0.5" in first.stdout
    assert "precision fp32 (auto: no CUDA device)" in first.stdout  # mixed precision only on GPUs
    # Resumed with fewer flags: the run's own settings, not the recipe's defaults.
    resumed = train(numbers_data, tmp_path, "--max-steps", "5")
    assert "resuming with the run's saved settings" in resumed.stdout
    assert (
        "gradient compression fp16, lr scale 0.5" in resumed.stdout and "changed --max-steps 3 -> 5" in resumed.stdout
    )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["grad_compression"], saved["lr_scale"], saved["max_steps"]) == ("fp16", 0.5, 5)
    refused = train(numbers_data, tmp_path, "--grad-compression", "powersgd", check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        "error: --grad-compression 'powersgd' differs from the run's 'fp16': a resumed "
        "run keeps its settings; start a new --run to change them"
    )


def test_a_checkpoint_resumes_only_at_the_global_batch_it_was_trained_at(numbers_data, tmp_path):
    """On more ranks with its saved batch a run trained each step left at a larger global batch (its learning
    rate, sample stream and steps counted the old one). fab train keeps it (resume.keep_global_batch); a
    launch that does not is refused by every rank before a step."""
    train(numbers_data, tmp_path, "--max-steps", "2", "--batch-per-gpu", "8")
    refused = train(numbers_data, tmp_path, "--max-steps", "4", procs=2, check=False)
    assert refused.returncode != 0 and "step 3/" not in refused.stdout
    assert (
        "was trained at a global batch of 8 (ranks x batch x accumulation: 1 x 8 x 1), this launch's is 16 (2 x 8 x 1)"
        in refused.stderr
    )
    kept = train(
        numbers_data, tmp_path, "--max-steps", "4", "--batch-per-gpu", "4", "--keep-global-batch", "8", procs=2
    )
    assert "changed --batch-per-gpu 8 -> 4" in kept.stdout and "step 4/4" in kept.stdout
    assert json.loads((tmp_path / "config.json").read_text())["world_size"] == 2  # what fab train's resume reads
    # A --max-tokens run's step is ranks x accumulation x its token budget: halving batch_per_gpu keeps nothing.
    tokens = tmp_path / "tokens"
    train(
        numbers_data, tokens, "--max-steps", "2", "--batch-per-gpu", "8", "--batching", "tokens", "--max-tokens", "64"
    )
    halved = ("--max-steps", "4", "--batch-per-gpu", "4", "--keep-global-batch", "8")
    refused = train(numbers_data, tokens, *halved, procs=2, check=False)
    assert "global batch of 8, 64 tokens (ranks x batch x accumulation: 1 x 8 x 1)" in refused.stderr
    assert "this launch's is 8, 128 tokens (2 x 4 x 1)" in refused.stderr and refused.stderr.count("error: ") == 1


def test_strict_device_mode_rejects_a_collective_tensor_made_without_a_device():
    cpu = torch.device("cpu")
    with strict_device._Tracker(cpu):
        host = torch.tensor([1.0, 2.0])
        derived = torch.stack([host * 2, host[:1].repeat(2)])
        placed = torch.zeros(2, device=cpu)
        moved = host.to(cpu)
        mixed = placed + host
    for made_on_the_host in (host, derived):
        with pytest.raises(RuntimeError, match=r"all_reduce got a tensor made on the host at test_training.py:\d+"):
            strict_device.check("all_reduce", [made_on_the_host], cpu)
    for on_the_device in (placed, moved, mixed):
        strict_device.check("all_reduce", [[on_the_device]], cpu)
    with pytest.raises(RuntimeError, match="tensor on cpu, not on the trainer's device meta"):
        strict_device.check("broadcast", [placed], torch.device("meta"))


def test_gpu_ranks_get_gloo_for_cpu_tensors_besides_nccl():
    from torch.distributed.distributed_c10d import BackendConfig

    from train import distributed

    gpu = BackendConfig(distributed.backend_for(torch.device("cuda", 0))).get_device_backend_map()
    assert gpu == {"cpu": "gloo", "cuda": "nccl"}
    assert distributed.backend_for(torch.device("cpu")) == "gloo"


def test_fab_checks_training_steps_run_the_trainers_collectives_and_clean_up(tmp_path):
    """checkup.check_training as `fab check` runs it, on this machine: a local shell for the head node's
    connection and torchrun (strict-device mode) for mpirun."""
    from invoke import Context

    from clusterops.inventory import Inventory, Node, SshSettings
    from clusterops.run import checkup

    inv = Inventory(
        cluster="c",
        source="local",
        gpus_per_node=2,
        python=sys.executable,
        code_dir=str(TRAIN_DIR),
        data_dir=str(tmp_path),
        nodes=[Node(0, "node0", "127.0.0.1", "127.0.0.1")],
        ssh=SshSettings(user="root", port=4444, key_file="/k", known_hosts="/kh"),
    )
    prefix = [
        "env",
        f"{strict_device.ENV}=1",
        "OMP_NUM_THREADS=1",
        "GLOO_SOCKET_IFNAME=lo",
        sys.executable,
        str(REPO / "tests" / "mpirun_exports.py"),  # mpirun's -x PYTHONPATH=...
        *TORCHRUN,
        "2",
        "--no-python",
    ]
    line = checkup.check_training(Context(), inv, prefix, inv.code_dir)
    assert re.match(
        rf"training: {checkup.CHECK_STEPS} steps on 2 ranks with the trainer's collectives: ok "
        rf"\(steps={checkup.CHECK_STEPS}, .*eval_loss=",
        line,
    ), line
    assert not (tmp_path / "runs" / ".check").exists()


def test_a_checkpoint_at_least_every_n_minutes_besides_the_step_interval(numbers_data, tmp_path):
    """--checkpoint-minutes bounds the lost work in time: 0.001 min (60 ms) on two ranks with a step interval
    (1000) the run never reaches. Rank 0's clock decides; the step's existing flag all-reduce carries it."""
    args = ["--max-steps", "12", "--batch-per-gpu", "4", "--keep-checkpoints", "100", "--checkpoint-minutes", "0.001"]
    result = train(numbers_data, tmp_path, *args, procs=2)
    steps = [int(p.name[5:13]) for p in checkpoint.list_steps(tmp_path)]
    assert len(steps) >= 4 and steps[-1] == 12, (steps, result.stdout[-2000:])
    assert re.search(r"checkpoint \S+step_00000012\.pt \(\d+\.\d MB in \d+\.\d\d s\)", result.stdout)
    bad = train(numbers_data, tmp_path / "bad", "--checkpoint-minutes", "-1", check=False)
    refusal = "error: invalid --checkpoint-minutes -1.0: 0 (steps only) or a positive number of minutes\n"
    assert bad.returncode == 2 and bad.stderr == refusal


def test_translate_with_no_checkpoint_is_one_line(tmp_path):
    """`fab fetch` during a run brought no checkpoint and translate printed a traceback (issue 23 §9):
    every entry point gives one line for a missing file."""
    missing = tmp_path / "runs" / "r1" / "checkpoints" / "best.pt"
    result = subprocess.run(
        [sys.executable, "-m", "train.translate", str(missing)],
        input="",
        capture_output=True,
        text=True,
        env=tool_env(),
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip().splitlines() == [result.stderr.strip()] and f"no checkpoint at {missing}" in result.stderr
    )


def test_a_rank_given_gpus_whose_torch_finds_none_stops_instead_of_training_on_the_cpu(monkeypatch):
    """The NVIDIA runtime gives a container GPUs by NVIDIA_VISIBLE_DEVICES; torch finding no CUDA device
    there (a driver older than the image's CUDA, a GPU lost) used to pick the CPU and gloo silently."""
    from train import distributed

    info = distributed.DistInfo(rank=3, world_size=4, local_rank=1, launcher="mpirun")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine runs it too
    with pytest.raises(SystemExit, match=r"rank 3 was given GPUs \(NVIDIA_VISIBLE_DEVICES=all\) but torch .* finds no"):
        distributed.device_for(info, {"NVIDIA_VISIBLE_DEVICES": "all"})
    for none in ({}, {"NVIDIA_VISIBLE_DEVICES": "void"}, {"NVIDIA_VISIBLE_DEVICES": "none"}):
        assert distributed.device_for(info, none) == torch.device("cpu")


def test_a_local_rank_past_the_gpus_stops_instead_of_sharing_one(monkeypatch):
    """Local rank 4 of 8 on a node whose container has 4 GPUs took GPU 0 again (local rank modulo the
    count), and NCCL's first collective then failed every rank ("Duplicate GPU detected")."""
    from train import distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    three = distributed.DistInfo(rank=7, world_size=16, local_rank=3, launcher="mpirun")
    assert distributed.device_for(three, {}) == torch.device("cuda", 3) == chosen[0]
    with pytest.raises(SystemExit, match=r"rank 12 is local rank 4 but torch sees 4 GPU\(s\): one rank per GPU"):
        distributed.device_for(distributed.DistInfo(rank=12, world_size=16, local_rank=4), {})
