"""Real text end to end: Debian's trans-de-en dictionary (the Ding data set, installed by
scripts/setup.sh, never committed) through prepare.py, the SentencePiece tokenizer, the Transformer on
2 ranks (torchrun, gloo), greedy decoding and the project's BLEU; and that BLEU against a published
WMT17 figure, on the newstest2017 references and system outputs shipped in sacrebleu's source package."""

import bz2
import io
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_training import train

from train import ding, prepare
from train.evaluate import bleu

# The smallest recipe that shows it on 2 CPU cores: transformer-tiny (d_model 128, 2+2 layers).
SHORT = [
    "--d-model",
    "128",
    "--ffn",
    "512",
    "--dropout",
    "0",
    "--max-len",
    "48",
    "--eval-batch",
    "50",
    "--log-every",
    "50",
    "--warmup-steps",
    "50",
]


@pytest.fixture(scope="module")
def ding_data(tmp_path_factory) -> Path:
    """The Ding data set as `prepare.py ding` builds it (a smaller vocabulary: faster to train)."""
    out = tmp_path_factory.mktemp("ding")
    prepare.main(["ding", "--out", str(out), "--vocab", "2000"])
    return out


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_ding_pairs_are_real_sentences_in_a_deterministic_split(ding_data, capsys):
    meta = json.loads((ding_data / "meta.json").read_text())
    sizes = meta["sizes"]
    assert 15_000 < sizes["train"] < 25_000 and 600 < sizes["valid"] < 1_500 and 600 < sizes["test"] < 1_500
    splits = {
        name: list(zip(_lines(ding_data / f"{name}.en"), _lines(ding_data / f"{name}.de"), strict=True))
        for name in sizes
    }
    assert {name: len(pairs) for name, pairs in splits.items()} == sizes
    # Line i of .de translates line i of .en: every pair is one sub-entry of one dictionary line.
    entries = [line.split(" :: ", 1) for line in ding.PATH.read_text(encoding="utf-8").splitlines() if " :: " in line]
    for en, de in splits["test"][:: max(1, sizes["test"] // 25)]:
        assert any(de in german and en in english for german, english in entries), (en, de)
    # Splits by the English text's hash: disjoint, and the same split for a sentence every time.
    english = {name: {en for en, _ in pairs} for name, pairs in splits.items()}
    assert not (english["train"] & english["valid"]) and not (english["train"] & english["test"])
    assert not (english["valid"] & english["test"])
    assert all(ding.split_of(en) == name for name, pairs in splits.items() for en, _ in pairs[:200])
    assert 5 <= statistics.median(len(en.split()) for en, _ in splits["train"]) <= 10
    assert all(re.search(r"[.?!]$", en) and re.search(r"[.?!]$", de) for en, de in splits["train"])
    assert meta["request"]["version"].startswith("devel ") and meta["license"] == "GPL-2+"
    prepare.main(["ding", "--out", str(ding_data), "--vocab", "2000"])
    assert "already prepared" in capsys.readouterr().out


def test_dictionary_lines_give_example_sentences_only():
    """The format (ding.py's docstring): `German :: English`, ` | ` sub-entries paired by position,
    `;` variants, `{}`/`[]` annotations; templates with etw./sth. are not sentences."""
    lines = [
        "# Version :: devel 2099-01-01",
        "Haus {n} | Häuser {pl} | Das Haus ist alt. [ugs.] :: house | houses | The house is old.",
        "Er kam.; Er ging. | Kommst du? :: He came. | Are you coming?",
        "etw. tun. | jdm. helfen. :: to do sth. | to help sb.",
        "Nur ein Teil. :: only a part.",
        "Zwei | Teile. :: Two parts.",
        "Das Haus ist alt. :: The house is old.",
        "Ja, {adv}; Jawohl! :: Yes!",
    ]
    assert ding.pairs_from_lines(lines) == [
        ("The house is old.", "Das Haus ist alt."),
        ("He came.", "Er kam."),
        ("Are you coming?", "Kommst du?"),
        ("Yes!", "Jawohl!"),
    ]


def test_without_the_package_prepare_says_how_to_install_it_in_one_line(tmp_path):
    out = tmp_path / "ding"
    with pytest.raises(SystemExit) as stopped:
        prepare.main(["ding", "--out", str(out), "--source", str(tmp_path / "no-such-file")])
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert "apt-get install trans-de-en" in message
    assert not out.exists()


@pytest.mark.slow
def test_a_model_memorises_a_few_hundred_real_pairs_across_two_ranks(ding_data, tmp_path):
    """Tokenizer -> Transformer -> greedy decode -> BLEU on real German: 256 short pairs seen in
    training are translated back almost perfectly (it learned to read the source, not a language model)."""
    pairs = [
        (en, de)
        for en, de in zip(_lines(ding_data / "train.en"), _lines(ding_data / "train.de"), strict=True)
        if len(en.split()) <= 6 and len(de.split()) <= 6
    ][:256]
    data = tmp_path / "memorise"
    prepare.write_dataset(data, {"train": pairs, "valid": pairs, "test": pairs}, 500, {"request": "memorise"})
    result = train(
        data, tmp_path / "run", *SHORT, "--label-smoothing", "0", "--max-steps", "150", "--batch-per-gpu", "16",
        "--lr-scale", "0.5", "--eval-every", "150", "--eval-samples", "256", procs=2,
    )  # fmt: skip  # BLEU 37 at step 100, 89 at 125, 98.1 at 150 (and 98.5 at 200) on this machine
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"memorised 256 real pairs: BLEU {summary['bleu']:.1f}")
    assert "2 process(es) via torchrun" in result.stdout and summary["bleu"] > 90


@pytest.mark.slow
def test_a_short_run_on_the_train_split_beats_copying_the_source_on_held_out_text(ding_data, tmp_path):
    result = train(
        ding_data, tmp_path, *SHORT, "--max-steps", "300", "--batch-per-gpu", "16", "--lr-scale", "0.5",
        "--eval-every", "300", "--eval-samples", "100", procs=2,
    )  # fmt: skip
    held_out = json.loads((tmp_path / "summary.json").read_text())["bleu"]
    sources, references = _lines(ding_data / "valid.en")[:100], _lines(ding_data / "valid.de")[:100]
    copy = bleu(sources, references)  # English left as it is scores on names, numbers, punctuation
    print(f"held-out BLEU after 300 steps: {held_out:.2f}; copying the source: {copy:.2f}")
    assert "2 process(es) via torchrun" in result.stdout
    assert held_out > 2 * copy and copy > 0


# ---------------------------------------------------------------- BLEU against a published figure

SACREBLEU_SDIST = "2.6.0"  # its sdist ships test/wmt17_en_de_systems.pkl.bz2 (since 2.0.0)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpu-cluster" / "sacrebleu-sdist"


class _DataOnly(pickle.Unpickler):
    """The file is a pickle from the internet: lists, tuples and strings only, never a class or a
    function (pickle's docs: "never unpickle data that could have come from an untrusted source")."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused {module}.{name}: only plain data is expected")


def wmt17_en_de() -> dict:
    """{system name: 3004 lines, "reference": [3004 lines]}, from sacrebleu's source package, fetched
    once into a cache outside the checkout."""
    archive = CACHE / f"sacrebleu-{SACREBLEU_SDIST}.tar.gz"
    if not archive.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(CACHE)]
        fetched = subprocess.run([*pip, f"sacrebleu=={SACREBLEU_SDIST}"], capture_output=True, text=True, timeout=300)
        if fetched.returncode != 0 or not archive.exists():
            if os.environ.get("CI"):
                pytest.fail(f"pip download sacrebleu=={SACREBLEU_SDIST} failed: {fetched.stderr.strip()[-500:]}")
            pytest.skip(f"cannot download sacrebleu=={SACREBLEU_SDIST}'s source package (offline?)")
    with tarfile.open(archive) as tar:
        member = tar.extractfile(f"sacrebleu-{SACREBLEU_SDIST}/test/wmt17_en_de_systems.pkl.bz2")
        assert member is not None
        systems = _DataOnly(io.BytesIO(bz2.decompress(member.read()))).load()
    out = dict(systems)
    out["reference"] = out["reference"][0]
    return out


def test_the_projects_bleu_gives_uedin_nmts_published_wmt17_score():
    """uedin-nmt's newstest2017 en->de submission scores BLEU 28.3 (cased, 13a tokenisation) in the
    WMT17 findings and on matrix.statmt.org; evaluate.bleu (what every eval reports) must agree."""
    data = wmt17_en_de()
    reference = data.pop("reference")
    assert len(data) == 16 and len(reference) == 3004
    scores = {name.split(".")[1]: bleu(lines, reference) for name, lines in data.items()}
    print("newstest2017 en->de BLEU: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(scores.items())))
    assert round(scores["uedin-nmt"], 1) == 28.3
    assert max(scores, key=scores.__getitem__) == "uedin-nmt"  # the best-scoring en->de system in BLEU
    assert bleu(reference, reference) == pytest.approx(100.0)


def test_fab_data_builds_the_ding_data_set_where_train_looks_for_it(tmp_path):
    """`fab data --dataset ding` runs this command on the head node; here on this machine."""
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
    argv = dataprep.prepare_argv(inv, "ding", str(TRAIN_DIR), ["--vocab", "1000"])
    assert argv[-5:] == ["ding", "--out", f"{tmp_path}/datasets/ding", "--vocab", "1000"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=tool_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "datasets" / "ding" / "meta.json").read_text())["request"]["dataset"] == "ding"
