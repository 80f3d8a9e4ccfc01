"""Refuse a context key that neither this app nor the CDK reads.

The CDK hands the app every context value it has (cdk.json, cdk.context.json, ~/.cdk.json, `-c`;
CDK Developer Guide, "Context values") and the app reads only the keys it asks for, so `-c nodez=3`
built the default 2 nodes without a word: TryGetContext returns None for a key never set, rather than
raising (CDK Developer Guide, "Save and retrieve context variable values", get-context-var.html), so a
misspelt key reads as "not set" (issue 23 §11). The CDK's own keys are feature flags
(`@aws-cdk/...`), `aws:cdk:...` settings, cached look-ups (`instance-type-offerings:...`, `ami:...`:
every one holds a ':'), `acknowledged-issue-numbers` (`cdk acknowledge`, aws-cdk lib/cli/cdk-toolkit.js)
and whatever the project's cdk.json or the user's ~/.cdk.json sets on purpose.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Iterable, Mapping

from .config import ClusterConfig

CDK_KEYS = frozenset({"acknowledged-issue-numbers"})


class UnknownContextKeyError(ValueError):
    """A context key nothing reads; the message is one line with the closest known key."""


def app_keys() -> list[str]:
    return [*ClusterConfig.keys(), "stack_name"]


def settings_keys(*paths: Path) -> set[str]:
    """The context keys set in cdk.json-like files (the project's, the user's ~/.cdk.json)."""
    keys: set[str] = set()
    for path in paths:
        try:
            context = json.loads(path.read_text()).get("context", {})
        except (OSError, ValueError, AttributeError):  # absent or not ours to judge: the CLI reports it
            continue
        keys.update(context if isinstance(context, dict) else ())
    return keys


def _is_cdk_key(key: str) -> bool:
    return key.startswith("@") or ":" in key or key in CDK_KEYS


def check_context_keys(context: Mapping[str, object], project_keys: Iterable[str]) -> None:
    known = set(app_keys()) | set(project_keys)
    unknown = sorted(key for key in context if key not in known and not _is_cdk_key(key))
    if unknown:
        raise UnknownContextKeyError("; ".join(_refusal(key) for key in unknown))


def _refusal(key: str) -> str:
    close = difflib.get_close_matches(key, app_keys(), n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"this app reads {', '.join(app_keys())}"
    return f"unknown context key '{key}': {hint}"
