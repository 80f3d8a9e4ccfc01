"""The templates stay what they were when the node-side renovation (issue 20) began: moving code
around must not change a byte of what CloudFormation deploys (only the image context's hash moves)."""

import pytest
from templates_golden import CONFIGS, golden, synthesize

pytestmark = pytest.mark.xdist_group("templates-golden")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_template_is_byte_identical_to_the_golden_one(name):
    expected = golden(name).read_text()
    assert synthesize(name) == expected, (
        f"{name}: the template changed; if on purpose, run `.venv/bin/python tests/templates_golden.py`"
    )
