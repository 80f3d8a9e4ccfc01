"""One thing `fab audit` found, and what it reports but never deletes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Reported, never deleted here: they go with something else, or are not only this cluster's.
KEPT = {
    "public-ipv4": "released when its instance stops or terminates",
    "cdk-assets": "shared by every CDK app of this account and region: `npx cdk gc --unstable=gc` "
    "deletes the unused ones",
}


@dataclass(frozen=True)
class Leftover:
    kind: str
    id: str
    detail: str
    usd_per_month: Optional[float]  # None: unknown
    retained: bool = False
