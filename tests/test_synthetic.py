"""`--synthetic` is a benchmark: a short default length, said in the run's settings line; an explicit
--max-steps (fab train --steps) still wins (issue 19 §10: the full 56,300-step ResNet-50 schedule on
2 x p4d.24xlarge is hours of two ~$33/h nodes for a throughput figure)."""

from train.catalog import RECIPES
from train.config import SYNTHETIC_STEPS, build_parser, config_from_args, settings_line


def _config(*args: str):
    return config_from_args(build_parser("").parse_args(list(args)))


def test_a_synthetic_run_defaults_to_a_short_benchmark_and_says_so():
    config = _config("--recipe", "resnet50", "--synthetic")
    assert config.max_steps == SYNTHETIC_STEPS < RECIPES["resnet50"]["max_steps"] // 50
    line = settings_line(config)
    assert f"{SYNTHETIC_STEPS} steps" in line and "synthetic" in line and "--steps" in line


def test_an_explicit_length_wins_and_real_data_keeps_the_recipes_schedule():
    assert _config("--recipe", "resnet50", "--synthetic", "--max-steps", "2000").max_steps == 2000
    assert "synthetic" not in settings_line(_config("--recipe", "resnet50", "--synthetic", "--max-steps", "2000"))
    assert _config("--recipe", "resnet50").max_steps == RECIPES["resnet50"]["max_steps"]
    # A recipe already shorter than the benchmark keeps its own length.
    assert _config("--recipe", "resnet-small", "--synthetic").max_steps == RECIPES["resnet-small"]["max_steps"]
