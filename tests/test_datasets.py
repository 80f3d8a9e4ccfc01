"""prepare.py: numbers splits, WMT16 from a loopback HTTP mirror (resumed downloads, SGM test sets,
shards), ImageNet layout checks and staging."""

import http.server
import io
import json
import tarfile
import threading

import imagenet
import prepare
import pytest
import wmt16
from data import DataSet


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
    from prepare import number_phrase

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
    dropped = set()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            name = self.path.rsplit("/", 1)[1]
            body = files[name]
            start = int(self.headers.get("Range", "bytes=0-")[6:].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            if name == "de-en.tgz" and name not in dropped:  # the first transfer breaks halfway
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
    yield f"http://127.0.0.1:{server.server_address[1]}/mirror", dropped
    server.shutdown()


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
    prepare.main(["imagenet", "--source", str(source), "--stage-to", str(tmp_path / "again")])
    assert "2 classes, 6 train and 6 val images" in capsys.readouterr().out


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
