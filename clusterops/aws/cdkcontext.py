"""The CDK context `fab preflight` reads and writes, as `cdk synth` sees it: cdk.json's context,
cdk.context.json (cached look-ups: here the AZs offering a type and the pinned AMI), then the
command line's -c KEY=VALUE, which wins (CDK Developer Guide, "Context values")."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from stacks.config import ami_context_key, offerings_context_key


class ContextError(ValueError):
    """A malformed -c value; the message is one line."""


def read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def write(path: Path, updates: dict) -> None:
    """Merge `updates` into the file."""
    _save(path, read(path) | updates)


def forget(path: Path, key: str) -> None:
    """Remove `key` from the file, if there."""
    context = read(path)
    if context.pop(key, None) is not None:
        _save(path, context)


def _save(path: Path, context: dict) -> None:
    """Atomically: a temp file renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(context, indent=2) + "\n")
    os.replace(tmp, path)


def parse_cli(pairs: Iterable[str]) -> dict[str, str]:
    """-c KEY=VALUE pairs as `cdk deploy -c` takes them (the value may contain '=')."""
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ContextError(f"invalid -c {pair!r}: expected KEY=VALUE, as with `cdk deploy -c`")
        values[key.strip()] = value
    return values


def merged(cdk_json: Path, context_file: Path, cli: dict[str, str]) -> dict:
    """What `cdk synth` would see: cdk.context.json, cdk.json's context over it, -c over both."""
    project = json.loads(cdk_json.read_text()).get("context", {}) if cdk_json.exists() else {}
    return read(context_file) | project | cli


def cache_offerings(context_file: Path, region: str, instance_type: str, zones: list[str]) -> None:
    """The AZs offering the type, where `cdk synth` reads them to place the subnet."""
    write(context_file, {offerings_context_key(region, instance_type): sorted(zones)})


def pinned_ami(context: dict, region: str, parameter: str) -> Optional[str]:
    value = context.get(ami_context_key(region, parameter))
    return value if isinstance(value, str) and value.startswith("ami-") else None


def pin_ami(context_file: Path, region: str, parameter: str, image_id: str) -> None:
    write(context_file, {ami_context_key(region, parameter): image_id})
