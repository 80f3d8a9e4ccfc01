"""One line of `fab preflight`: a check's name, whether it passed, and what it found."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False  # not checked (and not a failure)

    @property
    def label(self) -> str:
        return "--  " if self.skipped else ("ok  " if self.ok else "FAIL")
