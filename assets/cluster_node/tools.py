"""The one way node programs run an external command: tests/test_image.py reads the literal argv of
every `run([...])` call in this package to check the image provides each command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence


def have(command: str) -> bool:
    return shutil.which(command) is not None


def run(argv: Sequence[str], timeout: Optional[float] = None, merge: bool = False) -> tuple[int, str]:
    """(exit status, stdout; with `merge` stderr too). A missing command is exit 127 as in a shell,
    a timeout is 124 as with timeout(1), with what it printed so far."""
    try:
        done = subprocess.run(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge else subprocess.DEVNULL,
            text=True,
            timeout=timeout,
            check=False,
        )
    except OSError:
        return 127, ""
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout
        return 124, out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
    return done.returncode, done.stdout


def is_mountpoint(path: Path) -> bool:
    """`path` is a mount point, as mountpoint(1) says: listed in /proc/self/mountinfo (a bind mount from
    the same file system too, which os.path.ismount misses: the emulated nodes' /data is one)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as handle:
            # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped (proc(5)).
            points = {_unescape(line.split()[4]) for line in handle if len(line.split()) > 4}
    except OSError:
        return os.path.ismount(target)
    return target in points


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def duration(seconds: float) -> str:
    """45s, 2m10s, 3h05m: one form for the trainer's step line and fab's status lines."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
