"""Real images through the real loader: Debian's dataset-fashion-mnist (Zalando's Fashion-MNIST, MIT;
installed by scripts/setup.sh, never committed) written by `prepare.py fashion-mnist` as an ImageFolder
of JPEGs, read by the ImageNet recipe's own pipeline (vision.py), learned by resnet-small on 2 ranks
(torchrun, gloo) to a held-out top-1 that shuffled labels cannot reach."""

import gzip
import json
import os
import random
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training import train

from train import fashion, prepare
from train.vision import ImageFolder, load_image

# 300 train images per class (3,000), the first 50 of each class of the package's t10k test set (500).
TRAIN_PER_CLASS, VAL_PER_CLASS = 300, 50
# resnet-small's recipe (ResNet-18, width 16, 32 px, batch 32/rank, SGD lr 0.4 per 256) for 200 steps:
# 2.1 epochs of the subset, about 13 s of CPU on 2 ranks.
RUN = ["--recipe", "resnet-small", "--max-steps", "200", "--warmup-steps", "20", "--eval-every", "200"]
RUN += ["--eval-samples", str(10 * VAL_PER_CLASS), "--log-every", "50", "--checkpoint-every", "1000"]
# Measured (one run each, the DataLoader pipeline): 76.8% with the real labels, 6.8% shuffled. Chance
# is 10%; on 500 held-out images its standard deviation is 1.3 points, so 60% is ~37 sigma above it.
TOP1_FLOOR, SHUFFLED_CEILING = 60.0, 20.0


@pytest.fixture(scope="module")
def fashion_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fashion")
    prepare.main(
        [
            "fashion-mnist",
            "--out",
            str(out),
            "--train-per-class",
            str(TRAIN_PER_CLASS),
            "--val-per-class",
            str(VAL_PER_CLASS),
        ]
    )
    return out


def _idx(path: Path, ndim: int) -> bytes:
    """The package's IDX file as the package's own utils/mnist_reader.py reads it (fixed offsets)."""
    with gzip.open(path, "rb") as handle:
        return handle.read()[4 + 4 * ndim :]


def test_writing_says_how_far_it_is(tmp_path, capsys):
    """Issue 32 §10: preparing fashion-mnist was silent for 8 s (all 70,000 images: ~11 s)."""
    counts = fashion.write(tmp_path, fashion.PATH, {"train": 3, "val": 1}, every=10)
    assert counts == {"train": 30, "val": 10}
    assert capsys.readouterr().out.splitlines() == [f"  train: {n} images written" for n in (10, 20, 30)] + [
        "  val: 10 images written"
    ]


def test_prepare_writes_a_balanced_image_folder_of_the_packages_images(fashion_data, capsys):
    """The IDX format (yann.lecun.com/exdb/mnist "THE IDX FILE FORMAT"; the package's mnist_reader.py
    reads labels at offset 8 and images at 16): every JPEG is its IDX image in the folder of its label."""
    meta = json.loads((fashion_data / "meta.json").read_text())
    assert meta["sizes"] == {"train": 10 * TRAIN_PER_CLASS, "val": 10 * VAL_PER_CLASS}
    assert meta["license"] == "MIT" and meta["request"]["version"] != "unknown"
    train_set, val_set = ImageFolder(fashion_data / "train"), ImageFolder(fashion_data / "val")
    assert train_set.classes == val_set.classes == list(fashion.FOLDERS)
    assert train_set.classes[0] == "0-t-shirt-top" and train_set.classes[9] == "9-ankle-boot"
    for split, folder, per_class in (("train", train_set, TRAIN_PER_CLASS), ("val", val_set, VAL_PER_CLASS)):
        prefix = fashion.SPLITS[split]
        labels = _idx(fashion.PATH / f"{prefix}-labels-idx1-ubyte.gz", 1)
        pixels = _idx(fashion.PATH / f"{prefix}-images-idx3-ubyte.gz", 3)
        assert [sum(1 for _, y in folder.samples if y == c) for c in range(10)] == [per_class] * 10
        for path, label in folder.samples[:: len(folder) // 40]:
            index = int(Path(path).stem)
            assert labels[index] == label  # the ImageFolder label is the package's label
            from PIL import Image

            decoded = Image.open(path).tobytes()
            original = pixels[index * 784 : (index + 1) * 784]
            assert max(abs(a - b) for a, b in zip(decoded, original, strict=True)) <= 40  # JPEG q95
            assert sum(abs(a - b) for a, b in zip(decoded, original, strict=True)) / 784 < 3
        # The first N of each class in file order: no index skipped below the largest one taken.
        taken = {int(Path(p).stem) for p, _ in folder.samples}
        for c in range(10):
            chosen = sorted(i for i in taken if labels[i] == c)
            assert chosen == [i for i in range(chosen[-1] + 1) if labels[i] == c]
    prepare.main(
        [
            "fashion-mnist",
            "--out",
            str(fashion_data),
            "--train-per-class",
            str(TRAIN_PER_CLASS),
            "--val-per-class",
            str(VAL_PER_CLASS),
        ]
    )
    assert "already prepared" in capsys.readouterr().out


def test_preparation_is_deterministic_and_a_new_subset_replaces_the_old(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    prepare.main(["fashion-mnist", "--out", str(first), "--train-per-class", "4", "--val-per-class", "3"])
    prepare.main(["fashion-mnist", "--out", str(second), "--train-per-class", "4", "--val-per-class", "3"])
    files = sorted(p.relative_to(first) for p in first.rglob("*.jpg"))
    assert len(files) == 70 and files == sorted(p.relative_to(second) for p in second.rglob("*.jpg"))
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
    prepare.main(["fashion-mnist", "--out", str(first), "--train-per-class", "2", "--val-per-class", "1"])
    assert len(list((first / "train").rglob("*.jpg"))) == 20 and len(list((first / "val").rglob("*.jpg"))) == 10
    assert sorted(p.name for p in first.iterdir()) == ["meta.json", "train", "val"]  # no scratch left


def test_without_the_package_prepare_says_how_to_install_it_in_one_line(tmp_path):
    out = tmp_path / "fashion"
    with pytest.raises(SystemExit) as stopped:
        prepare.main(["fashion-mnist", "--out", str(out), "--source", str(tmp_path / "no-such-dir")])
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert not out.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: b"\x00\x00\x08\x02" + raw[4:], "not an unsigned-byte IDX file with 3 dimension"),
        (lambda raw: raw[:-5], "data bytes, its header says"),
    ],
)
def test_a_damaged_idx_file_is_refused_in_one_line_before_anything_is_written(tmp_path, damage, message):
    source = tmp_path / "package"
    source.mkdir()
    for name in os.listdir(fashion.PATH):
        raw = gzip.open(fashion.PATH / name).read()
        if name == "t10k-images-idx3-ubyte.gz":
            raw = damage(raw)
        (source / name).write_bytes(gzip.compress(raw, compresslevel=1))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        prepare.main(["fashion-mnist", "--out", str(out), "--source", str(source)])
    assert message in str(stopped.value.code) and "\n" not in str(stopped.value.code)
    assert not out.exists()


def test_a_bad_subset_size_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--train-per-class must be at least 1, got 0"):
        prepare.main(["fashion-mnist", "--out", str(tmp_path / "o"), "--train-per-class", "0"])


def test_the_imagenet_pipeline_reads_the_28px_grayscale_jpegs(fashion_data):
    """The loader the ImageNet recipe uses: grayscale JPEG -> RGB, random-resized crop + flip (train) or
    resize + centre crop (eval) to 32 px, normalised with ImageNet's mean and std."""
    path = ImageFolder(fashion_data / "val").samples[0][0]
    evaluation = load_image(path, 32, train=False, seed=0)
    assert evaluation.shape == (3, 32, 32)
    assert torch.equal(evaluation, load_image(path, 32, train=False, seed=5))  # eval ignores the seed
    assert torch.allclose(evaluation[0] * 0.229 + 0.485, evaluation[1] * 0.224 + 0.456, atol=1e-5)  # gray
    crops = [load_image(path, 32, train=True, seed=s) for s in range(4)]
    assert torch.equal(crops[0], load_image(path, 32, train=True, seed=0))
    assert len({c.sum().item() for c in crops}) == 4  # augmented differently per seed


def _shuffled_copy(data: Path, out: Path) -> Path:
    """The same images and val set, the train labels permuted at random (hard links, no copies)."""
    files = sorted(p for p in (data / "train").rglob("*.jpg"))
    labels = [p.parent.name for p in files]
    random.Random(0).shuffle(labels)
    for folder in fashion.FOLDERS:
        (out / "train" / folder).mkdir(parents=True)
    for path, label in zip(files, labels, strict=True):
        os.link(path, out / "train" / label / path.name)
    os.symlink(data / "val", out / "val")
    return out


@pytest.mark.parametrize("labels", ["real", "shuffled"])
def test_resnet_small_learns_real_images_on_two_ranks(fashion_data, tmp_path, labels):
    """A held-out top-1 far above chance (10%) with the real labels; with the train labels shuffled
    the same run stays near chance: the floor is out of reach of a loader or label mapping that
    loses the image-label link."""
    data = fashion_data if labels == "real" else _shuffled_copy(fashion_data, tmp_path / "shuffled")
    result = train(data, tmp_path / "run", *RUN, procs=2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"fashion-mnist, resnet-small, 2 ranks, 200 steps, {labels} labels: top1 {summary['top1']:.1f}")
    assert summary["world_size"] == 2 and summary["steps"] == 200
    if labels == "real":
        assert summary["top1"] >= TOP1_FLOOR
    else:
        assert summary["top1"] <= SHUFFLED_CEILING
    assert "None" not in result.stdout


def test_a_subset_of_the_val_set_spans_its_classes(tmp_path):
    """eval_samples below the val set's size must not be its first N files: the folder is sorted by
    class, so a prefix would score one class only."""
    from train.recipes import eval_indices

    picked = eval_indices(100, 1000)
    assert len(picked) == 100 and len(set(picked)) == 100 and max(picked) >= 990
    assert eval_indices(2000, 1000) == list(range(1000))


def test_idx_header_reader_matches_the_package_sizes():
    (count, rows, cols), data = fashion.read_idx(fashion.PATH / "t10k-images-idx3-ubyte.gz", 3)
    assert (count, rows, cols) == (10_000, 28, 28) and len(data) == 10_000 * 784
    raw = gzip.open(fashion.PATH / "train-labels-idx1-ubyte.gz").read()
    assert struct.unpack(">ii", raw[:8]) == (2049, 60_000)  # magic 0x00000801, 60,000 labels


def test_every_recipe_defaults_to_a_data_set_fab_data_prepares():
    """Issue 23 §10: `fab train --recipe resnet-small` pointed at imagenet-small, which `fab data`
    rejects. Each recipe's default data set is one `fab data --dataset` accepts, and train.py's
    own default for the recipe is the same directory."""
    from clusterops.run import dataprep, launch
    from train.catalog import RECIPES

    for recipe in launch.RECIPES:
        assert launch.default_dataset(recipe) in dataprep.DATASETS, recipe
    assert launch.default_dataset("resnet-small") == "fashion-mnist"
    assert RECIPES["resnet-small"]["data"] == "/data/datasets/fashion-mnist"


def test_fab_data_runs_prepare_fashion_mnist_as_the_head_node_would(tmp_path):
    """`fab data --dataset fashion-mnist --extra ...`: the command prepare_argv builds, run for real."""
    from conftest import TRAIN_DIR, tool_env

    from clusterops.inventory import Inventory, Node, SshSettings
    from clusterops.run import dataprep

    inv = Inventory(
        cluster="c",
        source="local",
        gpus_per_node=1,
        python=sys.executable,
        code_dir=str(TRAIN_DIR),
        data_dir=str(tmp_path),
        nodes=[Node(0, "node0", "127.0.0.1", "127.0.0.1")],
        ssh=SshSettings(user="root", port=4444, key_file="/k", known_hosts="/kh"),
    )
    argv = dataprep.prepare_argv(
        inv, "fashion-mnist", str(TRAIN_DIR), ["--train-per-class", "2", "--val-per-class", "1"]
    )
    assert argv[-7:-4] == ["fashion-mnist", "--out", f"{tmp_path}/datasets/fashion-mnist"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=tool_env())
    assert done.returncode == 0, done.stderr[-2000:]
    meta = json.loads((tmp_path / "datasets" / "fashion-mnist" / "meta.json").read_text())
    assert meta["sizes"] == {"train": 20, "val": 10}


def test_the_package_is_installed_by_setup_and_by_the_image():
    """setup.sh (this machine, CI, the emulated cluster) and the Dockerfile (fab data runs prepare.py
    in the container on the head node) install the package; fab data's help names the data set."""
    from conftest import REPO

    setup = (REPO / "scripts" / "setup.sh").read_text()
    packages = re.search(r"APT_PACKAGES=\(([^)]*)\)", setup).group(1).split()
    assert fashion.PACKAGE in packages
    from test_image import image_apt_packages

    assert fashion.PACKAGE in image_apt_packages()
    assert "fashion-mnist" in (REPO / "fabfile" / "cluster.py").read_text().split("def data(")[0][-800:]


def test_fab_shows_the_runs_top1_and_nothing_unmeasured():
    """What `fab train --follow` prints at the end (terminal.summary_lines): an image run's top-1, and
    no `eval_loss: None` for a synthetic run, which evaluates nothing (issue 23 §10)."""
    from cluster_node.protocol.rundir import Summary
    from clusterops.terminal import summary_lines

    image = {"recipe": "resnet-small", "steps": 40, "eval_loss": 1.672, "top1": 34.0, "top5": 88.5, "bleu": None}
    measured = "\n".join(summary_lines(Summary.from_json(image)))
    assert "top1: 34" in measured and "top5: 88.5" in measured and "None" not in measured
    synthetic = {"recipe": "resnet-small", "steps": 3, "eval_loss": None, "top1": None, "top5": None}
    synthetic = "\n".join(summary_lines(Summary.from_json(synthetic)))
    assert "None" not in synthetic and "eval_loss" not in synthetic and "steps: 3" in synthetic
