"""A ResNet run's length. `--synthetic` is a benchmark: a short default length, said in the run's settings
line; an explicit --max-steps (fab train --steps) still wins (issue 19 §10: the full ResNet-50 schedule on
2 x p4d.24xlarge is hours of two ~$33/h nodes for a throughput figure). The resnet50 recipe's step counts
are for 8 x 256 images a step: any other global batch trains as many images."""

import math

import pytest

from train import train
from train.catalog import RECIPES
from train.config import (
    SYNTHETIC_STEPS,
    build_parser,
    config_from_args,
    resume_config,
    settings_line,
)


def _config(*args: str, world: int = 8, scaled: list | None = None):
    return config_from_args(build_parser("").parse_args(list(args)), world, scaled)


def test_a_synthetic_run_defaults_to_a_short_benchmark_and_says_so():
    config = _config("--recipe", "resnet50", "--synthetic")
    assert config.max_steps == SYNTHETIC_STEPS < RECIPES["resnet50"]["max_steps"] // 50
    line = settings_line(config)
    assert f"{SYNTHETIC_STEPS} steps" in line and "synthetic" in line and "--steps" in line


def test_an_explicit_length_wins_and_real_data_keeps_the_recipes_schedule():
    assert _config("--recipe", "resnet50", "--synthetic", "--max-steps", "2000").max_steps == 2000
    assert "synthetic" not in settings_line(_config("--recipe", "resnet50", "--synthetic", "--max-steps", "2000"))
    assert _config("--recipe", "resnet50").max_steps == RECIPES["resnet50"]["max_steps"]  # at 8 x 256
    # A recipe already shorter than the benchmark keeps its own length.
    assert _config("--recipe", "resnet-small", "--synthetic").max_steps == RECIPES["resnet-small"]["max_steps"]


@pytest.mark.parametrize("world, batch, accum", [(1, 256, 1), (4, 256, 1), (16, 256, 1), (16, 128, 2), (64, 256, 1)])
def test_resnet50_trains_the_recipes_images_warm_up_and_evaluations_whatever_the_global_batch(world, batch, accum):
    """Before: 56,300 steps on any cluster, so 2 x p4d.24xlarge (16 GPUs) trained 180 epochs, 16 of them
    warm-up, and `fab plan` priced both; the LR, scaled with the global batch, is tuned for 90."""
    recipe = RECIPES["resnet50"]
    args = ("--recipe", "resnet50", "--batch-per-gpu", str(batch), "--grad-accum", str(accum))
    scaled: list[str] = []
    config = _config(*args, world=world, scaled=scaled)
    global_batch = world * batch * accum
    for name, images in (("max_steps", 56_300 * 2048), ("warmup_steps", 5_000 * 2048), ("eval_every", 5_000 * 2048)):
        assert recipe[name] * 2048 == images
        assert getattr(config, name) == math.ceil(images / global_batch)
    assert _config(*args, "--max-steps", "1000", "--warmup-steps", "10", world=world).max_steps == 1000
    assert _config(*args, "--max-steps", "1000", "--warmup-steps", "10", world=world).warmup_steps == 10
    why = f"the recipe's for a global batch of 2048, this run's is {global_batch}"
    assert scaled == [
        f"step counts scaled: max_steps 56300 -> {config.max_steps}, warmup_steps 5000 -> {config.warmup_steps}, "
        f"eval_every 5000 -> {config.eval_every} ({why})"
    ]
    kept: list[str] = []  # --max-steps: the run's length in steps, nothing scaled, and said so
    given = _config(*args, "--max-steps", "1000", "--eval-every", "100", world=world, scaled=kept)
    assert (given.warmup_steps, given.eval_every) == (5_000, 100)
    assert kept == [f"step counts kept: warmup_steps 5000, {why} (its length given in steps)"]
    benchmark: list[str] = []  # --synthetic: 500 steps, a benchmark's length, and nothing scaled
    assert _config(*args, "--synthetic", world=world, scaled=benchmark).max_steps == SYNTHETIC_STEPS
    assert benchmark == [f"step counts kept: warmup_steps 5000, eval_every 5000, {why} (its length given in steps)"]
    at_reference: list[str] = []
    assert _config("--recipe", "resnet50", scaled=at_reference).max_steps == 56_300 and at_reference == []


def test_a_transformer_recipes_steps_stay_its_steps_and_a_resume_keeps_the_scaled_ones():
    base, tiny = (
        _config("--recipe", r, "--run-dir", "x", world=w)
        for r, w in (("transformer-base", 16), ("transformer-tiny", 3))
    )
    assert base.max_steps == 50_000 and tiny.max_steps == RECIPES["transformer-tiny"]["max_steps"]
    saved = _config("--recipe", "resnet50", world=16).to_dict()
    resumed, changes = resume_config(saved, build_parser("").parse_args(["--recipe", "resnet50"]))
    assert (resumed.max_steps, resumed.warmup_steps, changes) == (28_150, 2_500, [])


def test_the_trainer_scales_to_the_world_its_launcher_gives(monkeypatch, tmp_path):
    """train.main reads the world from mpirun's variables before the rendezvous."""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "16")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    args = build_parser("").parse_args(["--recipe", "resnet50", "--run-dir", str(tmp_path / "r")])
    config, changes, resumed = train.effective_config(args)
    assert (config.max_steps, config.warmup_steps, config.eval_every, resumed) == (28_150, 2_500, 2_500, False)
    assert changes == [
        "step counts scaled: max_steps 56300 -> 28150, warmup_steps 5000 -> 2500, eval_every 5000 -> 2500 "
        "(the recipe's for a global batch of 2048, this run's is 4096)"
    ]  # printed after the settings line
