"""The lists the trainer and fab share, defined once (standard library only: the laptop imports them):
the data sets `fab data` prepares and where, the named recipes with their default data set, the
precisions and the gradient compression modes."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

DATA_DIR = "/data"  # the shared file system on the nodes (clusterops.inventory's data_dir)
DATASETS = ("numbers", "ding", "wmt16-en-de", "fashion-mnist", "imagenet")
PRECISIONS = ("fp32", "fp16", "bf16")  # the trainer also takes "auto" (config.choose_precision)
# --attention: SDPA backends on CUDA (train.perf.attention_backends); auto: flash/memory-efficient, no cuDNN
ATTENTION = ("auto", "torch", "efficient", "flash", "cudnn", "math")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "auto")  # --grad-compression (commhooks.py, autocompress.py)


def dataset_dir(dataset: str, data_dir: str = DATA_DIR) -> str:
    """DATA/datasets/NAME: where `fab data` prepares a data set and where the recipes read it."""
    return f"{data_dir}/datasets/{dataset}"


def either(choices: tuple[str, ...]) -> str:
    """'a, b or c', for help texts and errors."""
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def default_dataset(recipe: str) -> str:
    """The data set a recipe reads unless --data (fab train --dataset) says otherwise."""
    return PurePosixPath(RECIPES[recipe]["data"]).name


def recipe_input(recipe: str) -> str:
    """What a recipe trains on: "images" (a vision recipe) or "text"."""
    return "images" if "vision" in RECIPES.get(recipe, {}) else "text"


def dataset_input(meta: dict | None, has_train_folder: bool) -> str | None:
    """What a prepared data set holds, from its meta.json (prepare.py's: a vocabulary for text, classes
    for images) or an image folder's train/ (ImageNet staged as is); None when neither says."""
    if meta and ("vocab_size" in meta or "src_lang" in meta):
        return "text"
    if (meta and "classes" in meta) or has_train_folder:
        return "images"
    return None


def input_mismatch(recipe: str, dataset: str, meta: dict | None, has_train_folder: bool) -> str | None:
    """'resnet-small trains on images; ding is text' where the two do not match, with the ones that do."""
    wanted, found = recipe_input(recipe), dataset_input(meta, has_train_folder)
    if found is None or found == wanted:
        return None
    fitting = [name for name in DATASETS if KNOWN_INPUTS.get(name) == wanted]
    recipes = [name for name in RECIPES if recipe_input(name) == found]
    a = {"images": "an image", "text": "a text"}
    return (
        f"{recipe} trains on {wanted}; {dataset} is {found}: use {a[wanted]} data set ({either(tuple(fitting))}) "
        f"or {a[found]} recipe ({either(tuple(recipes))})"
    )


def missing_data(dataset: str) -> str:
    """What to do about a data set that is not prepared: `fab data` for one it prepares; for any other
    name (a typo: `dingg`), the ones it prepares and the closest."""
    if dataset == "imagenet":  # not made here: fetched (or copied) onto /data
        return 'copy it onto /data: `fab data --dataset imagenet --extra "--from s3://BUCKET/PREFIX"` (-c data_bucket)'
    if dataset in DATASETS:
        return f"run `fab data --dataset {dataset}`"
    import difflib

    close = difflib.get_close_matches(dataset, DATASETS, n=1)
    return f"`fab data` prepares {either(DATASETS)}" + (f": did you mean --dataset {close[0]}?" if close else "")


# What each data set `fab data` prepares holds.
KNOWN_INPUTS = dict.fromkeys(("numbers", "ding", "wmt16-en-de"), "text") | dict.fromkeys(
    ("fashion-mnist", "imagenet"), "images"
)

# Each recipe's overrides of TrainConfig's defaults; `data` is its default data set's directory.
RECIPES: dict[str, dict[str, Any]] = {
    # The published transformer-base (Vaswani et al.; OpenSeq2Seq's "transformer" LR policy).
    "transformer-base": dict(data=dataset_dir("wmt16-en-de")),
    # The same code at toy size: CPU runs, tests and the local demo (numbers data set). Sentence batches:
    # in the numbers set a pair's length fixes its content, and length-bucketed batches cut the BLEU
    # after 200 steps from ~85 to ~33 (README, *Text input pipeline*); --batching tokens to compare.
    "transformer-tiny": dict(
        data=dataset_dir("numbers"),
        batching="sentences",
        max_steps=600,
        batch_per_gpu=64,
        lr_scale=1.0,
        warmup_steps=200,
        label_smoothing=0.1,
        log_every=50,
        eval_every=200,
        eval_samples=300,
        checkpoint_every=100,
        clip_grad=1.0,
        model=dict(d_model=128, layers=2, heads=4, ffn=512, dropout=0.1, max_len=128, pre_norm=True),
    ),
    # ResNet-50 on ImageNet (NVIDIA DeepLearningExamples' recipe: SGD with momentum, LR 0.256 per 256
    # images scaled with the global batch, warm-up then cosine, label smoothing, channels-last, AMP). 90
    # epochs, 8 of warm-up, at 8 x 256 images a step; other global batches: as many images (reference_batch).
    "resnet50": dict(
        data=dataset_dir("imagenet"),
        max_steps=56_300,
        reference_batch=2048,
        batch_per_gpu=256,
        warmup_steps=5_000,
        label_smoothing=0.1,
        log_every=100,
        eval_every=5_000,
        eval_samples=50_000,
        eval_batch=256,
        checkpoint_every=2_500,
        precision="fp16",
        vision=dict(arch="resnet50"),
    ),
    # A small ResNet at 32 px for CPU runs and tests: Fashion-MNIST (prepare.py fashion-mnist), any
    # image folder, or --synthetic.
    "resnet-small": dict(
        data=dataset_dir("fashion-mnist"),
        max_steps=300,
        batch_per_gpu=32,
        warmup_steps=30,
        label_smoothing=0.1,
        log_every=20,
        eval_every=100,
        eval_samples=500,
        eval_batch=64,
        checkpoint_every=100,
        vision=dict(
            arch="resnet18",
            width=16,
            image_size=32,
            num_classes=10,
            base_lr=0.4,
            momentum=0.9,
            weight_decay=5e-4,
        ),
    ),
}
