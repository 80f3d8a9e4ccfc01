"""The one way node programs run an external command: tests/test_image.py reads the literal argv of
every `run([...])` call in this package to check the image provides each command."""

from __future__ import annotations

import shutil
import subprocess
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
