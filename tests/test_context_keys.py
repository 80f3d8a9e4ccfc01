"""Unknown context keys, in-process (stacks/contextkeys.py; the CLI path is in test_synth_cli.py).

The CDK passes the app every context value it knows (CDK Developer Guide, "Context values": cdk.json,
cdk.context.json, ~/.cdk.json and `-c`) and ignores any that the app does not read, so a misspelt key
was silently dropped (issue 23 §11). Keys the CDK itself puts there are feature flags (`@aws-cdk/...`),
`aws:cdk:...` settings, cached look-ups whose keys contain ':' (cdk.context.json) and
`acknowledged-issue-numbers` (`cdk acknowledge`, aws-cdk lib/cli/cdk-toolkit.js).
"""

import pytest

from stacks.config import ClusterConfig
from stacks.contextkeys import UnknownContextKeyError, check_context_keys

# What the CLI 2.x passed a probe app with cdk.json's context and `-c nodez=3` (measured), minus nodez.
CDK_PASSES = {
    "@aws-cdk/core:failSynthOnValidationErrors": True,
    "@aws-cdk/core:target-partitions": ["aws", "aws-cn"],
    "aws:cdk:bundling-stacks": ["**"],
    "aws:cdk:enable-asset-metadata": True,
    "aws:cdk:enable-path-metadata": True,
    "aws:cdk:version-reporting": True,
    "instance-type-offerings:region=us-east-1:instance-type=g5.xlarge": ["us-east-1a"],
    "ami:region=us-east-1:ssm-parameter=/aws/service/x/latest/ami-id": "ami-0123456789abcdef0",
    "acknowledged-issue-numbers": [16603],
}


def test_every_key_the_app_or_the_cdk_uses_passes():
    ours = {key: "x" for key in [*ClusterConfig.keys(), "stack_name"]}
    check_context_keys({**CDK_PASSES, **ours, "team": "ml"}, project_keys={"team"})


@pytest.mark.parametrize(
    "key, message",
    [
        ("nodez", "unknown context key 'nodez': did you mean 'nodes'?"),
        ("retain-data", "unknown context key 'retain-data': did you mean 'retain_data'?"),
        ("stackname", "unknown context key 'stackname': did you mean 'stack_name'?"),
    ],
)
def test_a_misspelt_key_is_refused_with_the_closest_known_key(key, message):
    with pytest.raises(UnknownContextKeyError) as raised:
        check_context_keys({**CDK_PASSES, key: "3"}, project_keys=set())
    assert str(raised.value) == message


def test_a_key_like_no_other_lists_what_the_app_reads_in_one_line():
    with pytest.raises(UnknownContextKeyError) as raised:
        check_context_keys({"zzz": "1"}, project_keys=set())
    text = str(raised.value)
    assert text.startswith("unknown context key 'zzz': this app reads ") and "\n" not in text
    assert "nodes" in text and "stack_name" in text


def test_preflight_refuses_the_misspelt_key_synth_would_refuse():
    """`fab preflight -c nodez=3` checked the default 2 nodes without a word; it reads the context
    `cdk deploy` sees, so it refuses what synth refuses, before any AWS call."""
    from conftest import run_fab

    result = run_fab("preflight", "-c", "nodez=3")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == ["error: unknown context key 'nodez': did you mean 'nodes'?"]
