"""The ResNet recipes: torchvision-identical architectures, the image pipeline, LR scaling and
warm-up, top-1/top-5 across ranks, synthetic mode, learning a small generated image folder."""

import json
import random

import pytest
import torch
from test_training import train

from train.recipes import momentum_sgd, warmup_cosine_lr
from train.vision import ResNet, _random_resized_crop, load_image

COLORS = [(220, 40, 40), (40, 200, 40), (40, 40, 220), (230, 220, 40)]


@pytest.mark.parametrize("arch, classes, params", [("resnet50", 1000, 25_557_032), ("resnet18", 1000, 11_689_512)])
def test_resnets_have_torchvisions_parameter_counts(arch, classes, params):
    assert sum(p.numel() for p in ResNet(arch, classes).parameters()) == params


def test_random_resized_crop_boxes_stay_inside_and_are_deterministic():
    for seed in range(200):
        box = _random_resized_crop(500, 375, random.Random(seed))
        assert 0 <= box[0] < box[2] <= 500 and 0 <= box[1] < box[3] <= 375
        assert box == _random_resized_crop(500, 375, random.Random(seed))


def test_warmup_then_cosine():
    assert warmup_cosine_lr(1, 10, 100, 1.0) == pytest.approx(0.1)
    assert warmup_cosine_lr(10, 10, 100, 1.0) == pytest.approx(1.0)
    assert warmup_cosine_lr(55, 10, 100, 1.0) == pytest.approx(0.5)
    assert warmup_cosine_lr(100, 10, 100, 1.0) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("fused", [True, None])
def test_a_first_step_skipped_for_an_inf_leaves_momentum_sgd_finite_and_exact(fused, monkeypatch):
    """fp16's first loss scale often overflows and GradScaler skips that step. torch's fused SGD (2.6, the
    training image's, and 2.13 here) then kept its uninitialised momentum buffers: NaN parameters from the
    next step on. The step after a skipped one must be SGD's first step exactly."""
    full_like = torch.full_like
    # Uninitialised memory, made to hold NaNs every time (what a freed block held, deterministically).
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: full_like(t, float("nan"), **kw))
    param = torch.nn.Parameter(torch.ones(1 << 10, 2))
    optimizer = momentum_sgd([{"params": [param], "weight_decay": 0.0}], 0.9, fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for step in range(2):
        for group in optimizer.param_groups:
            group["lr"] = 0.1
        loss = (param * 2).sum() * (float("inf") if step == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert torch.equal(optimizer.state[param]["momentum_buffer"], torch.full_like(param, 2.0))
    assert torch.allclose(param.detach(), torch.full_like(param, 1 - 0.1 * 2.0))


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """Four colour classes with noise, as JPEGs in the ImageNet folder layout."""
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    rng = random.Random(0)
    for split, count in (("train", 48), ("val", 12)):
        for index, color in enumerate(COLORS):
            directory = root / split / f"n0000000{index}"
            directory.mkdir(parents=True)
            for i in range(count):
                size = (rng.randint(40, 64), rng.randint(40, 64))
                pixels = bytes(
                    max(0, min(255, c + rng.randint(-30, 30))) for _ in range(size[0] * size[1]) for c in color
                )
                Image.frombytes("RGB", size, pixels).save(directory / f"img{i}.JPEG", quality=90)
    return root


def test_eval_images_are_centre_cropped_and_normalised(image_folder):
    image = load_image(str(next((image_folder / "val" / "n00000000").iterdir())), 32, train=False, seed=0)
    assert image.shape == (3, 32, 32)
    assert image[0].mean() > 1.0 > image[2].mean()  # red class: high red channel after normalisation


def test_small_resnet_learns_the_folder_on_two_ranks(image_folder, tmp_path):
    train(
        image_folder,
        tmp_path,
        "--recipe",
        "resnet-small",
        "--max-steps",
        "40",
        "--batch-per-gpu",
        "16",
        "--warmup-steps",
        "5",
        "--eval-every",
        "40",
        "--eval-samples",
        "48",
        "--log-every",
        "10",
        procs=2,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(f"resnet-small, 2 ranks, 40 steps: top1 {summary['top1']:.1f}, top5 {summary['top5']:.1f}")
    assert summary["world_size"] == 2 and summary["objects"] == "images"
    assert summary["top1"] >= 75 and summary["top5"] == 100.0
    state = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=False)
    assert state["classes"] == [f"n0000000{i}" for i in range(4)]


def test_lr_is_scaled_with_the_global_batch(image_folder, tmp_path):
    result = train(
        image_folder,
        tmp_path,
        "--recipe",
        "resnet-small",
        "--max-steps",
        "3",
        "--batch-per-gpu",
        "8",
        "--warmup-steps",
        "1",
        "--base-lr",
        "0.4",
        "--eval-samples",
        "8",
        "--log-every",
        "1",
        procs=2,
    )
    lrs = {
        int(s): float(lr)
        for s, lr in __import__("re").findall(r"step (\d+)/3 \(\d+%\) \| loss \S+ \| lr (\S+)", result.stdout)
    }
    peak = 0.4 * 16 / 256  # 2 ranks x 8 images
    assert lrs[1] == pytest.approx(warmup_cosine_lr(2, 1, 3, peak), rel=1e-2)


def test_synthetic_mode_needs_no_data(tmp_path):
    """Synthetic data has no eval set: the log says only what was measured (issue 23 §10: it
    printed `eval_loss None | top1 None`)."""
    result = train(
        tmp_path / "no-data",
        tmp_path / "run",
        "--recipe",
        "resnet-small",
        "--synthetic",
        "--max-steps",
        "3",
        "--batch-per-gpu",
        "4",
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["top1"] is None and summary["objects_per_s"] > 0
    assert "None" not in result.stdout and "eval_loss" not in result.stdout


def test_the_synthetic_batch_is_made_once_on_the_device_and_reused(tmp_path):
    from train.config import build_parser, config_from_args
    from train.distributed import DistInfo
    from train.recipes import ImageTask

    config = config_from_args(
        build_parser("").parse_args(
            [
                "--recipe",
                "resnet-small",
                "--synthetic",
                "--batch-per-gpu",
                "4",
                "--grad-accum",
                "2",
                "--data",
                str(tmp_path),
            ]
        )
    )
    task = ImageTask(config, DistInfo(), torch.device("cpu"))
    batches = task.batches(0) + task.batches(1)
    assert len(batches) == 4
    assert (
        len({images.data_ptr() for images, _ in batches}) == 1
        and len({labels.data_ptr() for _, labels in batches}) == 1
    )
    images, labels = batches[0]
    assert images.device == labels.device == task.device and images.shape == (4, 3, 32, 32)
    assert images.is_contiguous(memory_format=torch.channels_last)


def test_missing_image_folder_is_one_clear_error(tmp_path):
    result = train(tmp_path / "none", tmp_path / "run", "--recipe", "resnet-small", check=False)
    assert result.returncode == 2 and "python -m train.prepare imagenet --source" in result.stderr


def test_a_resumed_resnets_optimizer_state_has_its_parameters_layouts(tmp_path):
    """A checkpoint's tensors come back row-major (the state writer's host buffers) where the ResNet's
    weights are channels-last: CUDA's fused SGD refuses momentum whose strides differ from its parameter's,
    so every resumed ResNet run failed at its first step on a GPU (a CPU's kernel takes them)."""
    from train.config import build_parser, config_from_args
    from train.distributed import DistInfo
    from train.train import compose

    argv = ["--recipe", "resnet-small", "--synthetic", "--batch-per-gpu", "4"]
    train(tmp_path / "no-data", tmp_path / "run", *argv, "--max-steps", "2")
    config = config_from_args(
        build_parser("").parse_args(
            [*argv, "--max-steps", "3", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run")]
        )
    )
    trainer = compose(config, DistInfo(), torch.device("cpu"))
    assert trainer.step == 2
    convs = [p for p in trainer.model.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    for param in trainer.model.parameters():
        buffer = trainer.optimizer.state[param]["momentum_buffer"]
        assert buffer.stride() == param.stride() and torch.isfinite(buffer).all()
