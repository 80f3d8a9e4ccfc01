"""The templates stay what they were when the node-side renovation (issue 20) began: moving code
around must not change a byte of what CloudFormation deploys (only the image context's hash moves)."""

import json
import re

import pytest
from templates_golden import CONFIGS, golden, synthesize

pytestmark = pytest.mark.xdist_group("templates-golden")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_template_is_byte_identical_to_the_golden_one(name):
    expected = golden(name).read_text()
    assert synthesize(name) == expected, (
        f"{name}: the template changed; if on purpose, run `.venv/bin/python tests/templates_golden.py`"
    )


def _user_data_text(user_data: dict) -> str:
    """User data as CloudFormation renders it, each token shown as its JSON (only literals matter here)."""
    value = user_data.get("Fn::Base64", user_data)
    if isinstance(value, str):
        return value
    return "".join(p if isinstance(p, str) else json.dumps(p) for p in value["Fn::Join"][1])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_node_signals_its_own_resource_which_waits_for_that_signal(name):
    """SignalResource's LogicalResourceId must be the instance's key in the template: CDK appends a user-data
    hash to it (user_data_causes_replacement) that Stack.get_logical_id does not return (aws-cdk#11959)."""
    template = json.loads(golden(name).read_text())
    instances = {k: r for k, r in template["Resources"].items() if r["Type"] == "AWS::EC2::Instance"}
    assert instances
    for logical_id, resource in instances.items():
        text = _user_data_text(resource["Properties"]["UserData"])
        named = re.findall(r"^SIGNAL_RESOURCE=(\S+)$", text, re.M)
        assert named == [logical_id], f"{logical_id} signals {named}"
        assert resource["CreationPolicy"]["ResourceSignal"]["Count"] == 1
