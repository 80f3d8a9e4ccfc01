"""prepare.py: numbers splits, WMT16 from a loopback HTTP mirror (resumed downloads, SGM test sets,
shards), ImageNet layout checks and staging."""

import contextlib
import errno
import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

from train import imagenet, prepare, wmt16
from train.data import DataSet


def test_numbers_splits_are_disjoint_and_the_example_is_right(numbers_data):
    splits = {
        name: set(
            zip(
                (numbers_data / f"{name}.en").read_text().splitlines(),
                (numbers_data / f"{name}.de").read_text().splitlines(),
                strict=True,
            )
        )
        for name in ("train", "valid", "test")
    }
    assert [len(splits[n]) for n in ("train", "valid", "test")] == [6000, 200, 100]
    sources = {n: {en for en, _ in pairs} for n, pairs in splits.items()}
    assert not (sources["train"] & sources["valid"]) and not (sources["train"] & sources["test"])
    assert not (sources["valid"] & sources["test"])
    assert prepare.number_phrase(4271, "en") == "four thousand two hundred and seventy-one"
    assert prepare.number_phrase(4271, "de") == "viertausendzweihunderteinundsiebzig"


def test_numbers_rerun_is_a_no_op(numbers_data, capsys):
    before = (numbers_data / "train-00000.pt").stat().st_mtime_ns
    prepare.main(
        ["numbers", "--out", str(numbers_data), "--train", "6000", "--valid", "200", "--test", "100", "--vocab", "400"]
    )
    assert "already prepared" in capsys.readouterr().out
    assert (numbers_data / "train-00000.pt").stat().st_mtime_ns == before


def test_a_rerun_answers_without_importing_torch(numbers_data):
    """Every `fab data` runs prepare.py on the head node, mostly on a prepared set: that answer must not
    cost torch's import (~1.5 s of CPU a call). -X importtime lists every module the run imported."""
    args = ["--out", str(numbers_data), "--train", "6000", "--valid", "200", "--test", "100", "--vocab", "400"]
    command = [sys.executable, "-X", "importtime", "-m", "train.prepare", "numbers", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == f"{numbers_data}: already prepared\n", done
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "cluster_node.protocol.rundir" in imported and not imported & {"torch", "numpy"}


# ---------------------------------------------------------------- WMT16 from a loopback mirror


def _tgz(members: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _sgm(lines: list[str]) -> str:
    return (
        "<srcset>\n<doc>\n"
        + "".join(f'<seg id="{i}">{line}</seg>\n' for i, line in enumerate(lines, 1))
        + "</doc>\n</srcset>\n"
    )


def _corpus(prefix: str, count: int) -> tuple[str, str]:
    from train.prepare import number_phrase

    english = "".join(f"{prefix} has {number_phrase(i, 'en')} houses\n" for i in range(count))
    german = "".join(f"{prefix} hat {number_phrase(i, 'de')} Häuser\n" for i in range(count))
    return english, german


@pytest.fixture(scope="module")
def mirror():
    files = {}
    for (archive, en, de), size in zip(wmt16.TRAIN, (300, 200, 100), strict=True):
        english, german = _corpus(archive, size)
        name = wmt16.ARCHIVES[archive].rsplit("/", 1)[1]
        files[name] = _tgz({f"corpus/{en}": english + "\n", f"corpus/{de}": german + "\n"})
    dev = {f"dev/{member}": _sgm([f"valid &amp; line {i}" for i in range(20)]) for member in wmt16.VALID[1:]}
    files["dev.tgz"] = _tgz(dev)
    files["test.tgz"] = _tgz(
        {f"test/{member}": _sgm([f"test line {i}" for i in range(15)]) for member in wmt16.TEST[1:]}
    )
    dropped: set[str] = set()
    with serve(files, break_first={"de-en.tgz"}, dropped=dropped) as url:
        yield url, dropped


@contextlib.contextmanager
def serve(files: dict[str, bytes], break_first=frozenset(), dropped=None):
    """A loopback HTTP mirror of `files` by name that honours Range; the first transfer of each name
    in break_first stops halfway (recorded in `dropped`)."""
    dropped = set() if dropped is None else dropped

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.rsplit("/", 1)[1]
            body = files[name]
            start = int(self.headers.get("Range", "bytes=0-")[6:].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            if name in break_first and name not in dropped:  # the first transfer breaks halfway
                dropped.add(name)
                self.wfile.write(body[start : len(body) // 2])
                self.wfile.flush()
                self.connection.close()
                return
            self.wfile.write(body[start:])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/mirror"
    finally:
        server.shutdown()
        server.server_close()


def test_wmt16_is_prepared_from_the_archives_resuming_a_broken_download(mirror, tmp_path, capsys):
    url, dropped = mirror
    out = tmp_path / "wmt16"
    prepare.main(["wmt16-en-de", "--out", str(out), "--vocab", "300", "--mirror", url])
    printed = capsys.readouterr()
    assert dropped == {"de-en.tgz"} and "resuming" in printed.out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sizes"] == {"train": 600, "valid": 20, "test": 15}
    assert (out / "valid.en").read_text().splitlines()[3] == "valid & line 3"
    data = DataSet(out, max_len=64)
    assert len(data.train) == 600
    assert data.tokenizer.decode([data.train._get(data.train.tgt, 0)]) == ["europarl hat null Häuser"]
    prepare.main(["wmt16-en-de", "--out", str(out), "--vocab", "300", "--mirror", url])
    assert "already prepared" in capsys.readouterr().out


def test_wmt16_mismatched_corpora_are_reported(tmp_path):
    archive = tmp_path / "a.tgz"
    archive.write_bytes(_tgz({"x.en": "a\nb\n", "x.de": "a\n"}))
    with pytest.raises(RuntimeError, match="2 English lines but 1 German"):
        list(wmt16.clean_pairs(wmt16.read_member(archive, "x.en"), wmt16.read_member(archive, "x.de"), "x"))


# ---------------------------------------------------------------- ImageNet


def _imagenet(root, classes=("n01440764", "n01443537"), per_class=3):
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                (root / split / name / f"{name}_{i}.JPEG").write_bytes(b"\xff\xd8" + bytes(100 + i))
    return root


def test_imagenet_layout_is_checked_and_staged_resumably(tmp_path, capsys):
    source = _imagenet(tmp_path / "imagenet")
    found = imagenet.scan(source)
    assert (found["train"]["classes"], found["train"]["images"], found["val"]["images"]) == (2, 6, 6)
    target = tmp_path / "nvme"
    assert imagenet.stage(source, target) == (12, 0)
    (target / "train" / "n01440764" / "n01440764_0.JPEG").write_bytes(b"half")  # an interrupted copy
    assert imagenet.stage(source, target) == (1, 11)
    assert imagenet.scan(target)["val"]["images"] == 6
    with tempfile.TemporaryDirectory(dir="/dev/shm") as disk:  # a file system of its own, as a node's NVMe
        assert os.stat(disk).st_dev != os.stat("/").st_dev
        prepare.main(["imagenet", "--source", str(source), "--stage-to", f"{disk}/imagenet"])
        assert imagenet.scan(Path(disk) / "imagenet")["train"]["images"] == 6
    assert "2 classes, 6 train and 6 val images" in capsys.readouterr().out


def test_a_finished_staging_leaves_its_marker_and_a_full_disk_ends_in_one_line_without_one(tmp_path, monkeypatch):
    """A fresh read (session 30): ImageNet (~147 GB) onto g4dn.xlarge's 125 GB instance store ended in a traceback
    and left a partial copy that nothing told apart from a whole one; every rank reads its own node's copy."""
    source = _imagenet(tmp_path / "imagenet")
    target = tmp_path / "nvme"
    imagenet.stage(source, target)
    total = sum(p.stat().st_size for p in source.rglob("*.JPEG"))
    assert imagenet.staged_marker(target) == {"files": 12, "bytes": total, "source": str(source)}
    assert not (target / imagenet.STAGING_MARKER).exists()  # written first, removed last
    copy, calls = shutil.copyfile, [0]

    def fills_up(src, dst):
        calls[0] += 1
        if calls[0] > 4:
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        return copy(src, dst)

    monkeypatch.setattr(imagenet.shutil, "copyfile", fills_up)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as disk:  # a file system of its own, as a node's NVMe
        again = Path(disk) / "imagenet"
        with pytest.raises(SystemExit) as full:
            prepare.main(["imagenet", "--source", str(source), "--stage-to", str(again)])
        message = str(full.value)
        assert message.startswith(f"error: {again} is full after ") and "train from /data (no --data)" in message
        assert "\n" not in message and imagenet.staged_marker(again) is None
        assert (again / imagenet.STAGING_MARKER).exists()  # `fab train --data` tells it from a finished copy
        assert not [p for p in again.rglob("*") if p.name.endswith(".tmp")]  # no half-written file left
    monkeypatch.setattr(imagenet.shutil, "copyfile", copy)
    (target / "train" / "n01440764" / "n01440764_0.JPEG").unlink()  # a staging under way: no marker until it ends
    real_whole = imagenet._whole

    def looks_midway(dst, size, write):
        assert dst.name == imagenet.STAGED_MARKER or imagenet.staged_marker(target) is None
        return real_whole(dst, size, write)

    monkeypatch.setattr(imagenet, "_whole", looks_midway)
    assert imagenet.stage(source, target) == (1, 11) and imagenet.staged_marker(target)["files"] == 12


def test_staging_onto_the_root_file_system_is_refused_before_anything_is_copied(tmp_path, capsys):
    """A type without an instance store has no disk at /opt/dlami/nvme: the copy would fill the root volume."""
    source = _imagenet(tmp_path / "imagenet")
    target = Path("/gpu-cluster-no-disk-here/imagenet")  # under / itself: the root file system
    with pytest.raises(SystemExit) as refused:
        prepare.main(["imagenet", "--source", str(source), "--stage-to", str(target)])
    assert str(refused.value).startswith(f"error: --stage-to {target} is on the root file system (no disk")
    assert "\n" not in str(refused.value) and not target.parent.exists() and capsys.readouterr().out == ""


def test_a_host_directory_bound_into_the_container_counts_as_the_root_file_system(tmp_path):
    """In the container `/` is an overlay of its own device: a plain host directory bound in at /opt/dlami/nvme
    (a type without an instance store) is on the device of the files Docker binds from the host's root volume."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as overlay:  # stands in for the container's own `/`
        assert imagenet.root_volume_error(tmp_path / "nvme", roots=(overlay,)) is None
        assert imagenet.root_volume_error(tmp_path / "nvme", roots=(overlay, str(tmp_path))).startswith("--stage-to")
        assert imagenet.root_volume_error(Path(overlay) / "nvme", roots=(str(tmp_path),)) is None


def test_staging_copies_a_directorys_files_several_at_a_time(tmp_path, monkeypatch):
    """EFS answers each file's open and read over the network: one at a time, a node waits out 1.28M of them."""
    source, busy, most, lock = _imagenet(tmp_path / "imagenet"), [0], [0], threading.Lock()
    copy = shutil.copyfile

    def slow_copy(src, dst):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        time.sleep(0.2)
        with lock:
            busy[0] -= 1
        return copy(src, dst)

    monkeypatch.setattr(imagenet.shutil, "copyfile", slow_copy)
    assert imagenet.stage(source, tmp_path / "nvme") == (12, 0)
    assert most[0] == 3  # each class folder's three images at once
    assert imagenet.stage(source, tmp_path / "nvme") == (0, 12)


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no-val", "has no val/ directory"),
        ("flat-val", "holds 1 images directly"),
        ("empty-class", "1 without images"),
        ("class-mismatch", "different class folders"),
    ],
)
def test_imagenet_layout_errors_are_one_line(tmp_path, breakage, message):
    root = _imagenet(tmp_path / "imagenet")
    if breakage == "no-val":
        import shutil

        shutil.rmtree(root / "val")
    elif breakage == "flat-val":
        (root / "val" / "ILSVRC2012_val_00000001.JPEG").write_bytes(b"x")
    elif breakage == "empty-class":
        (root / "train" / "n09999999").mkdir()
    else:
        (root / "val" / "n01443537").rename(root / "val" / "n09999999")
    with pytest.raises(imagenet.LayoutError, match=message):
        imagenet.scan(root)
    with pytest.raises(SystemExit, match="^error: "):
        prepare.main(["imagenet", "--source", str(root)])


# ---------------------------------------------------------------- WMT16's real layouts, real text
# The archives as statmt.org serves them (members and paths as fairseq's and Nematus' WMT scripts
# extract them): Europarl v7 de-en.tgz holds europarl-v7.de-en.{de,en} at the top; Common Crawl the
# {cs,de,es,fr,ru}-en pairs plus .annotation files at the top; News Commentary v11 a
# training-parallel-nc-v11/ directory of pairs; dev.tgz and test.tgz the newstest SGML (setid, docs,
# <p>, one <seg> a line, text HTML-escaped) among the other years' sets. Filled with Ding sentences.


def _real_sgm(kind: str, setid: str, lang: str, lines: list[str]) -> str:
    import html

    head = f'<{kind} setid="{setid}" srclang="any"' + (f' trglang="{lang}">' if kind == "refset" else ">")
    docs, number = [], 1
    for start in range(0, len(lines), 40):  # 40 segments per document, numbered from 1 in each
        segs = "".join(
            f'<seg id="{i}">{html.escape(line)}</seg>\n' for i, line in enumerate(lines[start : start + 40], 1)
        )
        docs.append(f'<doc sysid="ref" docid="{number}-news" genre="news" origlang="en">\n<p>\n{segs}</p>\n</doc>\n')
        number += 1
    return head + "\n" + "".join(docs) + f"</{kind}>\n"


def _ding_archives(pairs):
    """The five archives, and the (english, german) pairs prepare must produce per split."""
    europarl, crawl, news = pairs[:3000], pairs[3000:5000], pairs[5000:6000]
    valid, test = pairs[6000:6300], pairs[6300:6600]
    en, de = [p[0] for p in europarl], [p[1] for p in europarl]
    for i in (10, 500, 2999):  # Europarl has empty lines, on one side or both: those pairs go
        en.insert(i, "")
        de.insert(i, "" if i != 500 else "Nur auf Deutsch.")
    crawl_en = [f"  {e}\t" if i % 7 == 0 else e.replace(" ", "  ", 1) for i, (e, _) in enumerate(crawl)]
    other = "".join(f"line {i}\n" for i in range(50))
    files = {
        "de-en.tgz": _tgz({"europarl-v7.de-en.en": "\n".join(en) + "\n", "europarl-v7.de-en.de": "\n".join(de) + "\n"}),
        "training-parallel-commoncrawl.tgz": _tgz(
            {
                **{f"commoncrawl.{pair}-en.{side}": other for pair in ("cs", "fr") for side in (pair, "en")},
                "commoncrawl.de-en.annotation": other,
                "commoncrawl.de-en.en": "".join(line + "\n" for line in crawl_en),
                "commoncrawl.de-en.de": "".join(d + "\n" for _, d in crawl),
            }
        ),
        "training-parallel-nc-v11.tgz": _tgz(
            {
                "training-parallel-nc-v11/news-commentary-v11.cs-en.en": other,
                "training-parallel-nc-v11/news-commentary-v11.de-en.en": "".join(e + "\n" for e, _ in news),
                "training-parallel-nc-v11/news-commentary-v11.de-en.de": "".join(d + "\n" for _, d in news),
            }
        ),
        "dev.tgz": _tgz(
            {
                "dev/newstest2013.en": other,
                "dev/newstest2014-deen-src.de.sgm": _real_sgm("srcset", "newstest2014", "de", [d for _, d in valid]),
                "dev/newstest2014-deen-src.en.sgm": _real_sgm("srcset", "newstest2014", "en", [e for e, _ in valid]),
                "dev/newstest2014-deen-ref.de.sgm": _real_sgm("refset", "newstest2014", "de", [d for _, d in valid]),
            }
        ),
        "test.tgz": _tgz(
            {
                "test/newstest2016-deen-src.de.sgm": _real_sgm("srcset", "newstest2016", "de", [d for _, d in test]),
                "test/newstest2016-ende-src.en.sgm": _real_sgm("srcset", "newstest2016", "en", [e for e, _ in test]),
                "test/newstest2016-ende-ref.de.sgm": _real_sgm("refset", "newstest2016", "de", [d for _, d in test]),
            }
        ),
    }
    return files, {"train": europarl + crawl + news, "valid": valid, "test": test}


def test_the_real_wmt16_preparation_on_real_text_keeps_every_pair_aligned(tmp_path):
    """wmt16.py (the code that prepares the 4.5M pairs) on archives in the real layouts, filled with
    Ding sentences: line i of train.de is the translation of line i of train.en, none lost or shifted."""
    from train import ding

    pairs = ding.load()[:6600]
    files, expected = _ding_archives(pairs)
    out = tmp_path / "wmt16"
    with serve(files) as url:
        prepare.main(["wmt16-en-de", "--out", str(out), "--vocab", "1000", "--mirror", url])
    for split, wanted in expected.items():
        got = list(zip((out / f"{split}.en").read_text().splitlines(), (out / f"{split}.de").read_text().splitlines()))
        assert len(got) == len(wanted), split
        assert got == wanted, next((i, g, w) for i, (g, w) in enumerate(zip(got, wanted)) if g != w)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sizes"] == {"train": 6000, "valid": 300, "test": 300} and meta["vocab_size"] == 1000
    data = DataSet(out, max_len=256)
    assert len(data.train) == 6000
    sample = range(0, 6000, 37)
    decoded = data.tokenizer.decode([data.train._get(data.train.tgt, i) for i in sample])
    assert decoded == [expected["train"][i][1] for i in sample]  # the shards hold the same lines, in order
    pairs_valid, _, references = data.split("valid")
    pieces = [pairs_valid.target(i) for i in range(len(pairs_valid))]
    assert references == [d for _, d in expected["valid"]] and sum(t == 1 for p in pieces for t in p) == 0  # no <unk>
