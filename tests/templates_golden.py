"""The synthesized templates of five configurations, as the app builds them, normalised only where
a template must change with the code it ships (the image context's asset hash and tag). Issue 20's
renovation keeps these byte-identical; a change to the stack on purpose regenerates them:

    .venv/bin/python tests/templates_golden.py     # rewrite tests/golden/*.template.json
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
PINS = {"availability_zone": "us-east-1a", "ami_id": "ami-0123456789abcdef0"}
CONFIGS = {
    "default": {"ssh_cidr": "203.0.113.7/32"},
    "ssm-private": {"access": "ssm", "private_subnet": "true"},
    "p4d": {"access": "ssm", "private_subnet": "true", "instance_type": "p4d.24xlarge"},
    "spot": {"ssh_cidr": "203.0.113.7/32", "spot": "true", "instance_type": "g5.12xlarge"},
    "eight-nodes": {"ssh_cidr": "203.0.113.7/32", "nodes": "8"},
}
_ASSET_HASH = re.compile(r"\b[0-9a-f]{64}\b")
_CONTEXT_TAG = re.compile(r'(")( )[0-9a-f]{16}"')  # the image tag after the context URL, a part of its Fn::Join


def synthesize(name: str) -> str:
    """One configuration's template through the app's own path (stacks.pins.synth_config, cdk.json's
    feature flags), as normalised JSON text."""
    import aws_cdk

    from stacks.cluster_stack import GpuClusterStack
    from stacks.pins import synth_config

    context = json.loads((HERE.parent / "cdk.json").read_text())["context"]
    app = aws_cdk.App(context=context)
    config = synth_config({**PINS, **CONFIGS[name]}, region=None)
    stack = GpuClusterStack(app, f"GpuCluster-{config.cluster_name}", config=config)
    template = json.loads(_normalised(json.dumps(app.synth().get_stack_by_name(stack.stack_name).template)))
    return json.dumps(_resources_sorted(template), indent=1, sort_keys=True) + "\n"


def _normalised(text: str) -> str:
    return _CONTEXT_TAG.sub(r'\1\2<tag>"', _ASSET_HASH.sub("<asset-hash>", text))


def _resources_sorted(value):
    """IAM statements' Resource lists in one order: CDK orders them by their text, asset hashes included, so
    the bootstrap script's and the image context's objects swap places as their contents change."""
    if isinstance(value, dict):
        return {
            k: sorted(v, key=json.dumps) if k == "Resource" and isinstance(v, list) else _resources_sorted(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_resources_sorted(v) for v in value]
    return value


def golden(name: str) -> Path:
    return GOLDEN / f"{name}.template.json"


if __name__ == "__main__":
    import os

    # jsii on the pinned Node in node_modules, as conftest sets it for the tests
    os.environ["PATH"] = f"{HERE.parent / 'node_modules' / '.bin'}:{os.environ.get('PATH', '')}"
    GOLDEN.mkdir(exist_ok=True)
    for config_name in CONFIGS:
        golden(config_name).write_text(synthesize(config_name))
        print(f"wrote {golden(config_name)}")
