"""WMT16 English->German as the original recipe gets it: Europarl v7, Common Crawl and News
Commentary v11 for training (4.5M pairs), newstest2014 for validation, newstest2016 for test.

Resumable: downloads continue where they stopped (HTTP Range), extracted corpora and finished
shards are kept, and everything is written atomically; re-running skips finished work.
"""

from __future__ import annotations

import html
import re
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Iterator

from train.data import SHARD_PAIRS, Tokenizer, atomic_write_bytes, write_pairs

ARCHIVES = {
    "europarl": "http://www.statmt.org/europarl/v7/de-en.tgz",
    "commoncrawl": "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
    "news-commentary": "http://data.statmt.org/wmt16/translation-task/training-parallel-nc-v11.tgz",
    "dev": "http://data.statmt.org/wmt16/translation-task/dev.tgz",
    "test": "http://data.statmt.org/wmt16/translation-task/test.tgz",
}
# (archive, member suffix for English, member suffix for German)
TRAIN = [
    ("europarl", "europarl-v7.de-en.en", "europarl-v7.de-en.de"),
    ("commoncrawl", "commoncrawl.de-en.en", "commoncrawl.de-en.de"),
    ("news-commentary", "news-commentary-v11.de-en.en", "news-commentary-v11.de-en.de"),
]
VALID = ("dev", "newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm")
TEST = ("test", "newstest2016-ende-src.en.sgm", "newstest2016-ende-ref.de.sgm")
MAX_WORDS = 250
_SEG = re.compile(r"<seg[^>]*>(.*)</seg>", re.I)


def url_for(name: str, mirror: str | None) -> str:
    url = ARCHIVES[name]
    return f"{mirror.rstrip('/')}/{url.rsplit('/', 1)[1]}" if mirror else url


def download(url: str, dest: Path, retries: int = 5, log=print) -> Path:
    """Download to dest, resuming a partial `.part` file with an HTTP Range request."""
    if dest.exists():
        return dest
    part = dest.with_name(dest.name + ".part")
    for attempt in range(1, retries + 1):
        have = part.stat().st_size if part.exists() else 0
        request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                if have and response.status != 206:
                    have = 0  # the server ignored the range: start over
                total = have + int(response.headers.get("Content-Length", 0) or 0)
                with open(part, "ab" if have else "wb") as handle:
                    done, last = have, 0.0
                    while chunk := response.read(1 << 20):
                        handle.write(chunk)
                        done += len(chunk)
                        if time.monotonic() - last > 1.0 or done == total:
                            last = time.monotonic()
                            share = f"{100 * done / total:5.1f}%" if total else ""
                            print(f"\r  {dest.name}: {done / 1e6:8.1f} MB {share}", end="", file=sys.stderr)
            print(file=sys.stderr)
            if total and done < total:  # the connection closed early: read() does not raise
                raise OSError(f"connection closed at {done} of {total} bytes")
            part.rename(dest)
            return dest
        except (urllib.error.URLError, OSError, TimeoutError) as error:
            log(f"  {dest.name}: attempt {attempt}/{retries} stopped ({error}); resuming")
            time.sleep(min(2**attempt, 30) if attempt < retries else 0)
    raise RuntimeError(f"could not download {url} after {retries} attempts; re-run to resume")


def read_member(archive: Path, suffix: str) -> list[str]:
    with tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(suffix)), None)
        if member is None:
            raise RuntimeError(f"{archive.name} has no member ending in {suffix}")
        handle = tar.extractfile(member)
        if handle is None:
            raise RuntimeError(f"{archive.name}: {member.name} is not a regular file")
        text = handle.read().decode("utf-8", errors="replace")
    if suffix.endswith(".sgm"):
        return [html.unescape(m.group(1)).strip() for m in map(_SEG.search, text.splitlines()) if m]
    return text.split("\n")[:-1] if text.endswith("\n") else text.split("\n")


def clean_pairs(english: list[str], german: list[str], name: str) -> Iterator[tuple[str, str]]:
    if len(english) != len(german):
        raise RuntimeError(f"{name}: {len(english)} English lines but {len(german)} German lines")
    for en, de in zip(english, german):
        en, de = " ".join(en.split()), " ".join(de.split())
        if en and de and len(en.split()) <= MAX_WORDS and len(de.split()) <= MAX_WORDS:
            yield en, de


def write_text(path: Path, lines: Iterable[str]) -> None:
    data = "".join(line + "\n" for line in lines).encode()
    atomic_write_bytes(path, lambda f: f.write(data))


def prepare(out: Path, vocab_size: int, mirror: str | None, log=print) -> dict:
    downloads = out / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    archives = {}
    for name in ARCHIVES:
        url = url_for(name, mirror)
        log(f"download {name}: {url}")
        archives[name] = download(url, downloads / url.rsplit("/", 1)[1], log=log)
    if not (out / "train.de").exists():
        log("extracting and cleaning the training corpora")
        pairs = [
            p
            for archive, en, de in TRAIN
            for p in clean_pairs(read_member(archives[archive], en), read_member(archives[archive], de), en)
        ]
        write_text(out / "train.en", (p[0] for p in pairs))
        write_text(out / "train.de", (p[1] for p in pairs))
    for split, (archive, en, de) in (("valid", VALID), ("test", TEST)):
        if not (out / f"{split}.de").exists():
            split_pairs = list(clean_pairs(read_member(archives[archive], en), read_member(archives[archive], de), en))
            write_text(out / f"{split}.en", (p[0] for p in split_pairs))
            write_text(out / f"{split}.de", (p[1] for p in split_pairs))
    if not (out / "spm.model").exists():
        log(f"training a {vocab_size}-piece shared BPE vocabulary")
        Tokenizer.train([str(out / "train.en"), str(out / "train.de")], str(out / "spm"), vocab_size)
    tokenizer = Tokenizer(out / "spm.model")
    english = (out / "train.en").read_text().splitlines()
    german = (out / "train.de").read_text().splitlines()
    shards = range(0, len(english), SHARD_PAIRS)
    for index, start in enumerate(shards):
        shard = out / f"train-{index:05d}.pt"
        if shard.exists():
            continue
        log(f"encoding shard {index + 1}/{len(shards)}")
        write_pairs(
            shard,
            tokenizer.encode(english[start : start + SHARD_PAIRS]),
            tokenizer.encode(german[start : start + SHARD_PAIRS]),
        )
    sizes = {"train": len(english)}
    for split in ("valid", "test"):
        sentences = (out / f"{split}.en").read_text().splitlines()
        write_pairs(
            out / f"{split}.pt",
            tokenizer.encode(sentences),
            tokenizer.encode((out / f"{split}.de").read_text().splitlines()),
        )
        sizes[split] = len(sentences)
    return sizes
