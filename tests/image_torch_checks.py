"""Run only by `make test-image-torch` (listed in tests/trainer_tests.txt; the name keeps the main run from
collecting it): this environment is the training image's (stacks/images.py), and checkpoints cross
between it and the checkout's torch (.venv) in both directions."""

import os
import platform
import subprocess
import sys

import numpy
import pytest
import torch
from conftest import REPO, tool_env
from test_training import SMALL, losses

from stacks import images
from train import checkpoint

MAIN_PYTHON = REPO / ".venv" / "bin" / "python"


def test_this_environment_has_the_images_python_torch_and_numpy():
    """scripts/test_image_torch.sh names the tag it built for; a lock that drifted from the table fails here."""
    row = images.lookup(f"{images.REPOSITORY}:{os.environ['GPU_CLUSTER_IMAGE_ENV']}")
    assert row is not None
    python = ".".join(platform.python_version_tuple()[:2])
    assert (python, torch.__version__.split("+")[0], numpy.__version__) == (row.python, row.torch_pypi, row.numpy)


def test_torchs_modules_are_compiled_once_not_in_every_process():
    """scripts/test_image_torch.sh compiles the environment's bytecode: without it (PYTHONDONTWRITEBYTECODE set,
    as on the test machines) every trainer process compiled torch again, ~3 s of CPU each."""
    import importlib.util

    import torch._dynamo  # what each optimizer's first call imports

    for module in (torch, torch._dynamo, numpy):
        assert module.__file__ and os.path.exists(importlib.util.cache_from_source(module.__file__)), module.__name__


def _train(python, data, run_dir, steps, *args):
    result = subprocess.run(
        [str(python), "-m", "train.train", "--data", str(data), "--run-dir", str(run_dir), *SMALL]
        + ["--max-steps", str(steps), "--batch-per-gpu", "8", "--checkpoint-every", "3", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=tool_env(OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("writer, reader", [("image", "checkout"), ("checkout", "image")])
def test_a_checkpoint_written_under_one_torch_resumes_under_the_other(numbers_data, tmp_path, writer, reader):
    """What holds across torch 2.6 (the image) and the checkout's torch: the checkpoint (torch.save's zip
    format, weights_only loading) loads and training goes on from its step with finite losses. What does
    not: bit-exact continuation (dropout masks and data order may be drawn differently: see README)."""
    if not MAIN_PYTHON.exists():
        pytest.fail(f"{MAIN_PYTHON} missing: run `make setup` first")
    python = {"image": sys.executable, "checkout": MAIN_PYTHON}
    versions = {}
    for side in ("image", "checkout"):
        versions[side] = subprocess.run(
            [str(python[side]), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
        ).stdout.strip()
    assert versions["image"] != versions["checkout"], "both sides run the same torch: nothing crosses versions"
    first = _train(python[writer], numbers_data, tmp_path, 6, "--dropout", "0.1")
    assert [p.name for p in checkpoint.list_steps(tmp_path)][-1] == "step_00000006.pt"
    second = _train(python[reader], numbers_data, tmp_path, 12, "--dropout", "0.1")
    assert "resuming from" in second.stdout and "at step 6" in second.stdout, second.stdout[-2000:]
    before, after = losses(first.stdout), losses(second.stdout)
    assert sorted(before) == list(range(1, 7)) and sorted(after) == list(range(7, 13))
    assert all(float(loss) == float(loss) and float(loss) < 100 for loss in after.values())  # finite, trained on
    assert checkpoint.load_latest(tmp_path)["step"] == 12
