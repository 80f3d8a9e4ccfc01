"""An evaluator of IAM identity-based policies, as the deploy rehearsal needs it: is a request (an action on a
resource ARN, with request context keys) allowed by a set of policy documents?

It follows the IAM User Guide's "Policy evaluation logic" for one account and identity-based policies only:
an explicit Deny wins, then any Allow, else the implicit deny. Supported, because the stack uses them:
Action/NotAction, Resource/NotResource with `*` and `?` wildcards (actions case-insensitively, ARNs
case-sensitively), and the condition operators StringEquals, StringNotEquals, StringLike, StringNotLike,
ArnEquals, ArnLike, ArnNotEquals, ArnNotLike and Bool, with `...IfExists` and the ForAnyValue:/ForAllValues:
set qualifiers, and policy variables in Resource (`${aws:username}`: the request context's value; a
statement whose variable has no value in the request matches nothing, as the IAM User Guide's "Policy
variables" says of a missing key). Other variable forms (`${*}`, defaults) and unknown operators are refused
loudly, never guessed. (tests/test_iampolicy.py holds it to those rules.)"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

ContextValue = Union[str, Sequence[str]]


@dataclass(frozen=True)
class Request:
    action: str  # service:Action
    resource: str  # an ARN, or "*" for actions without resource types
    context: Mapping[str, ContextValue] = ()  # type: ignore[assignment]


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


_VARIABLE = re.compile(r"\$\{([^}]*)\}")


def _wildcard(pattern: str, value: str, case_sensitive: bool) -> bool:
    if "${" in pattern:
        raise ValueError(f"policy variables are not supported by this evaluator here: {pattern}")
    regex = re.escape(pattern).replace(r"\*", ".*").replace(r"\?", ".")  # IAM has `*` and `?`, nothing else
    return re.fullmatch(regex, value, re.S if case_sensitive else re.S | re.IGNORECASE) is not None


def _action_matches(statement: dict, action: str) -> bool:
    if "Action" in statement:
        return any(_wildcard(a, action, False) for a in _as_list(statement["Action"]))
    return not any(_wildcard(a, action, False) for a in _as_list(statement["NotAction"]))


def _substituted(pattern: str, context: Mapping[str, ContextValue]) -> Optional[str]:
    """`pattern` with each ${key} replaced by the request's single value for it; None when one has none."""
    missing = False

    def value(match: re.Match) -> str:
        nonlocal missing
        key = match.group(1)
        if not re.fullmatch(r"[\w-]+:[\w/:.-]+", key):
            raise ValueError(f"policy variable form not supported by this evaluator: ${{{key}}}")
        found = next((v for k, v in context.items() if k.lower() == key.lower()), None)
        missing = missing or not isinstance(found, str)
        return found if isinstance(found, str) else ""

    replaced = _VARIABLE.sub(value, pattern)
    return None if missing else replaced


def _resource_matches(statement: dict, resource: str, context: Mapping[str, ContextValue]) -> bool:
    if "Resource" not in statement and "NotResource" not in statement:  # a resource policy's own resource
        return True
    key = "Resource" if "Resource" in statement else "NotResource"
    patterns = [_substituted(r, context) for r in _as_list(statement[key])]
    hit = any(p is not None and _wildcard(p, resource, True) for p in patterns)
    return hit if key == "Resource" else not hit


_STRING_TESTS = {
    "StringEquals": lambda want, got: want == got,
    "StringLike": lambda want, got: _wildcard(want, got, True),
    "ArnEquals": lambda want, got: want == got,
    "ArnLike": lambda want, got: _wildcard(want, got, True),
    "Bool": lambda want, got: str(want).lower() == str(got).lower(),
}
_NEGATED = {"StringNotEquals": "StringEquals", "StringNotLike": "StringLike", "ArnNotEquals": "ArnEquals"}
_NEGATED["ArnNotLike"] = "ArnLike"


def _condition_holds(operator: str, key: str, wanted, context: Mapping[str, ContextValue]) -> bool:
    qualifier, _, base = operator.rpartition(":")
    if_exists = base.endswith("IfExists")
    base = base.removesuffix("IfExists")
    negated = base in _NEGATED
    test = _STRING_TESTS.get(_NEGATED.get(base, base))
    if test is None or qualifier not in ("", "ForAnyValue", "ForAllValues"):
        raise ValueError(f"condition operator {operator} is not supported by this evaluator")
    if any("${" in str(w) for w in _as_list(wanted)):
        raise ValueError(f"policy variables are not supported by this evaluator in conditions: {wanted}")
    present = next((v for k, v in context.items() if k.lower() == key.lower()), None)
    if present is None:  # IAM: a missing key fails a condition, except ...IfExists and negations
        return if_exists or negated or qualifier == "ForAllValues"
    values = _as_list(present) if not isinstance(present, str) else [present]
    hits = [any(test(w, v) for w in _as_list(wanted)) != negated for v in values]
    return all(hits) if qualifier == "ForAllValues" else any(hits)


def _conditions_hold(statement: dict, context: Mapping[str, ContextValue]) -> bool:
    return all(
        _condition_holds(operator, key, wanted, context)
        for operator, pairs in statement.get("Condition", {}).items()
        for key, wanted in pairs.items()
    )


def statements(documents: Iterable[dict]) -> list[dict]:
    return [s for d in documents for s in _as_list(d.get("Statement", []))]


def evaluate(documents: Iterable[dict], request: Request) -> Decision:
    """IAM's decision for `request` under identity-based `documents` (each {"Statement": [...]})."""
    allow = None
    for statement in statements(documents):
        context = dict(request.context or {})
        if not (_action_matches(statement, request.action) and _resource_matches(statement, request.resource, context)):
            continue
        if not _conditions_hold(statement, context):
            continue
        if statement["Effect"] == "Deny":
            return Decision(False, f"explicitly denied by {statement.get('Sid') or statement}")
        allow = statement
    if allow is not None:
        return Decision(True, f"allowed by {allow.get('Sid') or allow.get('Action')}")
    return Decision(False, f"no statement allows {request.action} on {request.resource}")
