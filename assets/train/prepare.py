"""Prepare a data set for train.py.

    python -m train.prepare numbers --out /data/datasets/numbers
    python -m train.prepare ding --out /data/datasets/ding
    python -m train.prepare wmt16-en-de --out /data/datasets/wmt16-en-de
    python -m train.prepare fashion-mnist --out /data/datasets/fashion-mnist
    python -m train.prepare imagenet --source /data/datasets/imagenet --stage-to /opt/dlami/nvme/imagenet
    python -m train.prepare imagenet --source /data/datasets/imagenet --from s3://my-bucket/imagenet

`numbers`: an offline English->German corpus of number phrases made with num2words
("four thousand two hundred and seventy-one" -> "viertausendzweihunderteinundsiebzig"), 1-4 numbers
per sentence, with disjoint train/valid/test splits. Used by tests and the local demo.
`ding`: ~20,000 real English->German example sentences from Debian's trans-de-en dictionary
(see ding.py; `apt-get install trans-de-en` first), split by a hash of the English text.
`fashion-mnist`: 70,000 real 28x28 product images in 10 classes from Debian's dataset-fashion-mnist
(see fashion.py; `apt-get install dataset-fashion-mnist` first), written as an ImageFolder of JPEGs
(train/ and val/ by class) that the ResNet recipes' loader reads; --train-per-class/--val-per-class
take a smaller, balanced subset.
`wmt16-en-de`: the WMT16 corpora and test sets as the original recipe downloads them (see wmt16.py),
a 32k shared BPE vocabulary and binary shards; resumable. `imagenet`: checks the train/val folder
layout, fetching it from S3 first with --from, and optionally stages it onto local disk (see imagenet.py).
Re-running with the same arguments is a no-op; every file is written atomically. With --busy-dir
(fab data passes /data/.cluster/busy) a marker there stays fresh while it runs: the autostop
watchdog counts it as busy, so a long download or staging does not stop the cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from cluster_node.protocol import clusterdir, rundir


def number_phrase(value: int, lang: str) -> str:
    from num2words import num2words

    return num2words(value, lang=lang).replace(",", "")


def numbers_corpus(count: int, seed: int, max_numbers: int, max_digits: int) -> list[tuple[str, str]]:
    """`count` distinct (english, german) sentences, each 1..max_numbers numbers joined by ', '."""
    rng = random.Random(seed)
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    while len(pairs) < count:
        values = []
        for _ in range(rng.randint(1, max_numbers)):
            digits = rng.randint(1, max_digits)
            values.append(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
        english = ", ".join(number_phrase(v, "en") for v in values)
        if english in seen:
            continue
        seen.add(english)
        pairs.append((english, ", ".join(number_phrase(v, "de") for v in values)))
    return pairs


def write_dataset(out: Path, splits: dict[str, list[tuple[str, str]]], vocab_size: int, meta: dict) -> None:
    from train.data import SHARD_PAIRS, Tokenizer, atomic_write_bytes, write_pairs  # (see _write_meta)

    out.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        for lang, column in (("en", 0), ("de", 1)):
            text = "".join(pair[column] + "\n" for pair in pairs)
            atomic_write_bytes(out / f"{name}.{lang}", lambda f, t=text: f.write(t.encode()))
    print(f"training a {vocab_size}-piece shared BPE vocabulary", flush=True)
    Tokenizer.train([str(out / "train.en"), str(out / "train.de")], str(out / "spm"), vocab_size)
    tokenizer = Tokenizer(out / "spm.model")
    for name, pairs in splits.items():
        if name == "train":
            for shard, start in enumerate(range(0, len(pairs), SHARD_PAIRS)):
                chunk = pairs[start : start + SHARD_PAIRS]
                write_pairs(
                    out / f"train-{shard:05d}.pt",
                    tokenizer.encode([p[0] for p in chunk]),
                    tokenizer.encode([p[1] for p in chunk]),
                )
        else:
            write_pairs(
                out / f"{name}.pt", tokenizer.encode([p[0] for p in pairs]), tokenizer.encode([p[1] for p in pairs])
            )
    meta = dict(
        meta,
        src_lang="en",
        tgt_lang="de",
        vocab_size=tokenizer.vocab_size,
        sizes={name: len(pairs) for name, pairs in splits.items()},
    )
    _write_meta(out / "meta.json", meta)


def _write_meta(path: Path, meta: dict) -> None:
    """meta.json, atomically: it says the data set is complete. train.data (and torch, ~1.5 s of CPU) is imported
    only where there is data to write: a re-run on a prepared set (every `fab data`) answers without it."""
    from train.data import atomic_write_bytes

    atomic_write_bytes(path, lambda f: f.write(json.dumps(meta, indent=2).encode()))


def prepare_numbers(args: argparse.Namespace) -> None:
    out = Path(args.out)
    request = {
        "dataset": "numbers",
        "train": args.train,
        "valid": args.valid,
        "test": args.test,
        "seed": args.seed,
        "max_numbers": args.max_numbers,
        "max_digits": args.max_digits,
        "vocab": args.vocab,
    }
    meta_path = out / "meta.json"
    if meta_path.exists() and json.loads(meta_path.read_text()).get("request") == request:
        print(f"{out}: already prepared")
        return
    total = args.train + args.valid + args.test
    pairs = numbers_corpus(total, args.seed, args.max_numbers, args.max_digits)
    splits = {
        "test": pairs[: args.test],
        "valid": pairs[args.test : args.test + args.valid],
        "train": pairs[args.test + args.valid :],
    }
    write_dataset(out, splits, args.vocab, {"request": request})
    print(f"{out}: {args.train} train, {args.valid} valid, {args.test} test pairs")


def prepare_ding(args: argparse.Namespace) -> None:
    from train import ding

    out, source = Path(args.out), Path(args.source)
    try:
        request = {"dataset": "ding", "version": ding.version(source), "vocab": args.vocab}
        meta_path = out / "meta.json"
        if meta_path.exists() and json.loads(meta_path.read_text()).get("request") == request:
            print(f"{out}: already prepared")
            return
        splits = ding.split(ding.load(source))
    except ding.MissingPackage as error:
        sys.exit(f"error: {error}")
    write_dataset(out, splits, args.vocab, {"request": request, "source": str(source), "license": "GPL-2+"})
    sizes = {name: len(pairs) for name, pairs in splits.items()}
    print(
        f"{out}: {sizes['train']} train, {sizes['valid']} valid, {sizes['test']} test pairs (Ding {request['version']})"
    )


def prepare_wmt16(args: argparse.Namespace) -> None:
    from train import wmt16

    out = Path(args.out)
    request = {"dataset": "wmt16-en-de", "vocab": args.vocab}
    meta_path = out / "meta.json"
    if meta_path.exists() and json.loads(meta_path.read_text()).get("request") == request:
        print(f"{out}: already prepared")
        return
    sizes = wmt16.prepare(out, args.vocab, args.mirror)
    from train.data import Tokenizer  # (see _write_meta)

    vocab = Tokenizer(out / "spm.model").vocab_size
    meta = {"request": request, "src_lang": "en", "tgt_lang": "de", "vocab_size": vocab, "sizes": sizes}
    _write_meta(meta_path, meta)
    print(f"{out}: {sizes['train']} train, {sizes['valid']} valid, {sizes['test']} test pairs")


def prepare_fashion(args: argparse.Namespace) -> None:
    from train import fashion

    out, source = Path(args.out), Path(args.source)
    per_class = {"train": args.train_per_class, "val": args.val_per_class}
    try:
        request = {"dataset": "fashion-mnist", "version": fashion.version(source), "per_class": per_class}
        meta_path = out / "meta.json"
        if meta_path.exists() and json.loads(meta_path.read_text()).get("request") == request:
            print(f"{out}: already prepared")
            return
        fashion.load_split(source, "val")  # a damaged package fails here, before anything is written
    except (fashion.MissingPackage, fashion.FormatError) as error:
        sys.exit(f"error: {error}")
    out.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)  # the folders change first; a stop before the new meta means redo
    print(f"writing Fashion-MNIST {request['version']} as JPEGs into {out}", flush=True)
    counts = fashion.write(out, source, per_class)
    meta = {
        "request": request,
        "source": str(source),
        "license": "MIT",
        "classes": list(fashion.FOLDERS),
        "sizes": counts,
    }
    _write_meta(meta_path, meta)
    print(f"{out}: {counts['train']} train, {counts['val']} val images in {len(fashion.FOLDERS)} classes")


def prepare_imagenet(args: argparse.Namespace) -> None:
    from train import imagenet

    source = Path(args.source)
    if args.stage_to and (refused := imagenet.root_volume_error(Path(args.stage_to))):
        sys.exit(f"error: {refused}")
    try:
        if args.from_url:
            copied, skipped = imagenet.fetch_s3(args.from_url, source)
            print(f"fetched into {source}: {copied} downloaded, {skipped} already there")
        found = imagenet.scan(source)
    except imagenet.LayoutError as error:
        sys.exit(f"error: {error}")
    print(
        f"{source}: {found['train']['classes']} classes, {found['train']['images']} train and "
        f"{found['val']['images']} val images"
    )
    if args.stage_to:
        try:
            copied, skipped = imagenet.stage(source, Path(args.stage_to))
        except imagenet.StageError as error:
            sys.exit(f"error: {error}")
        print(f"staged into {args.stage_to}: {copied} copied, {skipped} already there")


@contextlib.contextmanager
def busy_marker(directory: Optional[str], what: str, every: float = 60.0) -> Iterator[None]:
    """While the body runs, keep DIRECTORY/HOST-PID.json refreshed every `every` seconds; removed
    at the end. A killed process leaves a marker that goes stale, so it stops counting."""
    if not directory:
        yield
        return
    path = Path(directory) / clusterdir.BUSY_MARKER.format(host=socket.gethostname(), pid=os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    done = threading.Event()

    def write() -> None:
        rundir.write_record(path, rundir.BusyMarker(what=what, time=time.time()))

    def refresh() -> None:
        while not done.wait(every):
            with contextlib.suppress(OSError):
                write()

    write()
    thread = threading.Thread(target=refresh, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-dir", help="keep a fresh marker here while running (autostop counts it as busy)")
    sub = parser.add_subparsers(dest="dataset", required=True)
    numbers = sub.add_parser("numbers", help="offline English->German number phrases")
    numbers.add_argument("--out", required=True)
    numbers.add_argument("--train", type=int, default=60_000)
    numbers.add_argument("--valid", type=int, default=500)
    numbers.add_argument("--test", type=int, default=500)
    numbers.add_argument("--seed", type=int, default=7)
    numbers.add_argument("--max-numbers", type=int, default=3)
    numbers.add_argument("--max-digits", type=int, default=4)
    numbers.add_argument("--vocab", type=int, default=600)
    dictionary = sub.add_parser("ding", help="real English->German sentences from Debian's trans-de-en")
    dictionary.add_argument("--out", required=True)
    dictionary.add_argument("--vocab", type=int, default=8000)
    dictionary.add_argument("--source", default="/usr/share/trans/de-en", help="the dictionary file")
    wmt = sub.add_parser("wmt16-en-de", help="WMT16 English->German (downloads ~1.5 GB)")
    wmt.add_argument("--out", required=True)
    wmt.add_argument("--vocab", type=int, default=32_000)
    wmt.add_argument("--mirror", help="base URL holding the same archive names (offline mirror)")
    fashion = sub.add_parser("fashion-mnist", help="real 28x28 images from Debian's dataset-fashion-mnist")
    fashion.add_argument("--out", required=True)
    fashion.add_argument("--source", default="/usr/share/datasets/fashion-mnist", help="the package's IDX files")
    fashion.add_argument("--train-per-class", type=int, help="first N train images of each class (default all 6,000)")
    fashion.add_argument("--val-per-class", type=int, help="first N val images of each class (default all 1,000)")
    # No abbreviations (`--f` for --from): fab data refuses --from with --all-nodes by its name.
    images = sub.add_parser(
        "imagenet", help="check an ImageNet folder, optionally stage it locally", allow_abbrev=False
    )
    images.add_argument("--source", required=True, help="folder with train/ and val/")
    images.add_argument("--stage-to", help="copy onto this local directory (e.g. NVMe)")
    images.add_argument(
        "--from", dest="from_url", help="s3://BUCKET/PREFIX: fetch it into --source first (-c data_bucket=BUCKET)"
    )
    args = parser.parse_args(argv)
    with busy_marker(args.busy_dir, f"prepare.py {args.dataset} on {socket.gethostname()}"):
        _prepare(args)


def _prepare(args: argparse.Namespace) -> None:
    if args.dataset == "ding":
        if args.vocab < 100:
            sys.exit(f"error: --vocab must be at least 100, got {args.vocab}")
        return prepare_ding(args)
    if args.dataset == "wmt16-en-de":
        return prepare_wmt16(args)
    if args.dataset == "imagenet":
        return prepare_imagenet(args)
    if args.dataset == "fashion-mnist":
        for name in ("train_per_class", "val_per_class"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                sys.exit(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        return prepare_fashion(args)
    for name in ("train", "valid", "test", "max_numbers", "max_digits", "vocab"):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.max_digits > 9:
        sys.exit(f"error: --max-digits must be at most 9, got {args.max_digits}")
    prepare_numbers(args)


if __name__ == "__main__":
    main()
