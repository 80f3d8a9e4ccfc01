"""launch.env, hostfile and command.json: the launch as today's text files (`fab train` writes them,
launcher.sh and supervise.py read them). A run spec replaces them (issue 20, step 5)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from .rundir import LAUNCH_ENV, RecordError, read_json


def parse_hostfile(text: str) -> tuple[tuple[str, int], ...]:
    """`IP slots=N` lines -> ((ip, N), ...); a line without slots= counts 1 (mpirun's rule)."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        slots = next((int(w.split("=", 1)[1]) for w in words[1:] if w.startswith("slots=")), 1)
        out.append((words[0], slots))
    return tuple(out)


def format_hostfile(hosts: Iterable[str], slots: int) -> str:
    return "".join(f"{host} slots={slots}\n" for host in hosts)


_LAUNCH_KEYS: tuple[tuple[str, str, str], ...] = (  # (KEY, field, kind) in launch.launch_env's order
    ("HOSTS", "hosts", "words"),
    ("SSH_CONFIG", "ssh_config", "str"),
    ("ACTIVE_FILE", "active_file", "str"),
    ("STALL_SECONDS", "stall_seconds", "int"),
    ("START_SECONDS", "start_seconds", "int"),
    ("POLL_SECONDS", "poll_seconds", "int"),
    ("PYTHON", "python", "str"),
    ("SLOTS", "slots", "int"),
    ("MAX_RESTARTS", "max_restarts", "int"),
    ("MIN_NODES", "min_nodes", "int"),
    ("HANG_FLOOR", "hang_floor", "int"),
    ("THEN_STOP", "then_stop", "flag"),
    ("CLUSTER_NAME", "cluster_name", "str"),
    ("AUTOSTOP", "autostop", "str"),
)


@dataclass(frozen=True)
class LaunchEnv:
    """launch.env: `KEY='shell-quoted value'` lines (launch.launch_env), sourced by launcher.sh. Every key
    is optional on reading (launcher.sh has defaults); AWS_* keys (region, emulator) are in `aws`, in
    their order."""

    hosts: Optional[tuple[str, ...]] = None
    ssh_config: Optional[str] = None
    active_file: Optional[str] = None
    stall_seconds: Optional[int] = None
    start_seconds: Optional[int] = None
    poll_seconds: Optional[int] = None
    python: Optional[str] = None
    slots: Optional[int] = None
    max_restarts: Optional[int] = None
    min_nodes: Optional[int] = None
    hang_floor: Optional[int] = None
    then_stop: bool = False
    cluster_name: Optional[str] = None
    autostop: Optional[str] = None
    aws: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_text(cls, text: str) -> LaunchEnv:
        raw: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip():
                try:
                    raw[key.strip()] = " ".join(shlex.split(value))
                except ValueError as error:
                    raise RecordError(f"{LAUNCH_ENV}: {line!r}: {error}") from None
        values: dict[str, Any] = {}
        try:
            for key, name, kind in _LAUNCH_KEYS:
                if key in raw:
                    text_value = raw.pop(key)
                    values[name] = _launch_value(kind, text_value)
        except ValueError as error:
            raise RecordError(f"{LAUNCH_ENV}: {error}") from None
        aws = {k: raw.pop(k) for k in list(raw) if k.startswith("AWS_")}
        if raw:
            raise RecordError(f"{LAUNCH_ENV}: unknown keys {', '.join(raw)}")
        return cls(**values, aws=aws)

    def to_text(self) -> str:
        lines = []
        for key, name, kind in _LAUNCH_KEYS:
            value = getattr(self, name)
            if value is None or (kind == "flag" and not value):
                continue
            text = " ".join(value) if kind == "words" else "1" if kind == "flag" else str(value)
            lines.append(f"{key}={shlex.quote(text)}\n")
        return "".join(lines + [f"{key}={shlex.quote(value)}\n" for key, value in self.aws.items()])


def _launch_value(kind: str, text: str) -> Any:
    if kind == "words":
        return tuple(text.split())
    if kind == "int":
        return int(text)
    if kind == "flag":
        return text == "1"
    return text


def read_argv(path: Path) -> Optional[tuple[str, ...]]:
    """command.json: the launch's argv as a JSON list of strings; None when missing or not one."""
    value = read_json(path)
    if isinstance(value, list) and all(isinstance(word, str) for word in value):
        return tuple(value)
    return None
