"""Real English->German sentence pairs from Debian's `trans-de-en` package (the Ding dictionary,
GPL-2+, https://dict.tu-chemnitz.de/), read from the installed file at preparation time: its text is
never part of this repository.

A dictionary line is `German :: English`; both sides hold the same number of ` | `-separated
sub-entries (a headword, its inflections, then examples), each a `;`-separated list of variants with
`{grammar}` and `[usage]` annotations. A sub-entry whose first sentence-like variant ends in `.`, `?`
or `!` on both sides is an example sentence: ~20,000 distinct pairs, median 7 words. Dictionary
templates (`etw.`, `jdm.`, `sth.`, `sb.`) and lowercase fragments are left out.

The split depends on nothing but a pair's English text (a hash), so it is the same on every machine
and for every package version; a sentence never moves between splits when others are added.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

PACKAGE = "trans-de-en"
PATH = Path("/usr/share/trans/de-en")
INSTALL = f"apt-get install {PACKAGE}"
# percent of pairs per held-out split (by hash of the English text); the rest is train
HELD_OUT = {"test": 5, "valid": 5}

_ANNOTATION = re.compile(r"\s*(\[[^\]]*\]|\{[^}]*\})")
_TEMPLATE = re.compile(r"\b(etw|jdm|jdn|jds|jd|sth|sb)\.|\bsb[’']s\b", re.I)
_ENDS = (".", "?", "!")
_STARTS_DE = "\"'„‚»"
_STARTS_EN = "\"'“‘"


class MissingPackage(FileNotFoundError):
    pass


def _sentence(side: str) -> str:
    """The first variant of a sub-entry that ends like a sentence, without annotations; else ''."""
    for variant in _ANNOTATION.sub("", side).split(";"):
        text = " ".join(variant.split())
        if text.endswith(_ENDS):
            return text
    return ""


def _starts_a_sentence(text: str, quotes: str) -> bool:
    return text[:1].isupper() or text[:1].isdigit() or text[:1] in quotes


def pairs_from_lines(lines) -> list[tuple[str, str]]:
    """(english, german) example sentences of the dictionary lines, first occurrence of each English
    sentence kept, in file order."""
    seen: dict[str, str] = {}
    for line in lines:
        if line.startswith("#") or " :: " not in line:
            continue
        german, english = line.rstrip("\n").split(" :: ", 1)
        de_parts, en_parts = german.split(" | "), english.split(" | ")
        if len(de_parts) != len(en_parts):
            continue  # a malformed entry: its sub-entries cannot be paired
        for de_part, en_part in zip(de_parts, en_parts):
            de, en = _sentence(de_part), _sentence(en_part)
            if not de or not en or _TEMPLATE.search(de) or _TEMPLATE.search(en):
                continue
            if _starts_a_sentence(de, _STARTS_DE) and _starts_a_sentence(en, _STARTS_EN):
                seen.setdefault(en, de)
    return list(seen.items())


def require(path: Path = PATH) -> Path:
    if not path.is_file():
        raise MissingPackage(
            f"{path} not found: the Ding data set needs Debian's {PACKAGE} package "
            f"(`apt-get update && {INSTALL}`, or scripts/setup.sh)"
        )
    return path


def load(path: Path = PATH) -> list[tuple[str, str]]:
    with open(require(path), encoding="utf-8") as handle:
        return pairs_from_lines(handle)


def version(path: Path = PATH) -> str:
    """The dictionary's own version line (`# Version :: devel 2023-01-30`), for the prepared meta."""
    with open(require(path), encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("# Version ::"):
                return line.split("::", 1)[1].strip()
            if not line.startswith("#"):
                break
    return "unknown"


def split_of(english: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(english.encode()).digest()[:8], "big") % 100
    for name, share in HELD_OUT.items():
        if bucket < share:
            return name
        bucket -= share
    return "train"


def split(pairs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {"train": [], "valid": [], "test": []}
    for pair in pairs:
        out[split_of(pair[0])].append(pair)
    return out
