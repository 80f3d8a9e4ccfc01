"""`cdk deploy` of the app into the moto server, through the pinned CDK CLI, as a user would run it after
`fab preflight` (which pins the offering AZs and the AMI in cdk.context.json). moto lacks placement groups,
AWS::EC2::KeyPair and AWS::KMS::Key in CloudFormation: a deploy here uses placement_group=false, an
existing key pair and flow_logs=false (the template tests cover them)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import boto3
from conftest import ACCOUNT, REGION, REPO, tool_env

from stacks.config import ami_context_key, offerings_context_key

AMI_PARAMETER = "/test/dlami/ami-id"
PINNED_AMI = "ami-03cf127a"  # one of moto's images
MOTO_LIMITS = ("-c", "placement_group=false", "-c", "flow_logs=false", "-c", f"ami_ssm_parameter={AMI_PARAMETER}")


def deploy(aws_env: dict, work: Path, context: dict[str, str], instance_type: str = "g4dn.2xlarge") -> Path:
    """Deploys with `-c key=value` for `context` (plus MOTO_LIMITS and a key pair, its private key in
    work/KEY_NAME.pem); returns the outputs file."""
    work.mkdir(parents=True, exist_ok=True)
    # The DLAMI's "latest" moves on after the pin: the deploy must still use the pinned AMI.
    ssm = boto3.client("ssm")
    ssm.put_parameter(Name=AMI_PARAMETER, Value="ami-0ffffffffffffffff", Type="String", Overwrite=True)
    key_name = context.get("key_name", f"{context.get('cluster_name', 'test')}-key")
    ec2 = boto3.client("ec2")
    if not ec2.describe_key_pairs(Filters=[{"Name": "key-name", "Values": [key_name]}])["KeyPairs"]:
        (work / f"{key_name}.pem").write_text(ec2.create_key_pair(KeyName=key_name)["KeyMaterial"])
    app = app_copy(work)
    (app / "cdk.context.json").write_text(
        json.dumps(
            {
                offerings_context_key(REGION, instance_type): ["us-east-1c", "us-east-1b"],
                ami_context_key(REGION, AMI_PARAMETER): PINNED_AMI,
            }
        )
    )
    args = [*MOTO_LIMITS, *(a for k, v in {"key_name": key_name, **context}.items() for a in ("-c", f"{k}={v}"))]
    outputs = work / "cdk-outputs.json"
    bootstrap(aws_env, work)
    deploy = ["deploy", "--method=direct", "--require-approval", "never", "-o", str(work / "cdk.out"), *args]
    _cdk([*deploy, "--outputs-file", str(outputs)], app, aws_env)
    return outputs


def app_copy(work: Path) -> Path:
    """work/app: the app's files as links. The CLI caches look-ups (an AZ list) in the app directory's
    cdk.context.json, which the checkout must not get."""
    app = work / "app"
    app.mkdir()
    for name in ("app.py", "cdk.json", "stacks", "assets", ".venv", "node_modules"):
        (app / name).symlink_to(REPO / name)
    return app


_BOOTSTRAPPED: set[str] = set()


def bootstrap(aws_env: dict, work: Path) -> None:
    """`cdk bootstrap` once per moto server (the CDKToolkit stack is per account and region), from outside the
    app: the CLI synthesizes an app it finds, which a deploy does again anyway."""
    if aws_env["AWS_ENDPOINT_URL"] in _BOOTSTRAPPED:
        return
    _cdk(["bootstrap", f"aws://{ACCOUNT}/{REGION}"], work, aws_env)
    _BOOTSTRAPPED.add(aws_env["AWS_ENDPOINT_URL"])


def _cdk(command: list[str], cwd: Path, aws_env: dict) -> None:
    result = subprocess.run(
        [str(REPO / "node_modules" / ".bin" / "cdk"), *command, "--no-notices"],
        cwd=cwd,
        env=tool_env(**aws_env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
