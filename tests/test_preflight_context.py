"""Issue 19 §4 (preflight side) and §6: `fab preflight` reads the same context `cdk deploy` does
(cdk.json, cdk.context.json, repeatable -c KEY=VALUE), says what it checked, pins the AMI the stack
will boot in cdk.context.json, and checks that the account/region is CDK-bootstrapped. Against the
moto server; Service Quotas (not emulated) fails its own line only."""

import json

import boto3
import pytest
from conftest import ACCOUNT, run_fab

from clusterops.aws import preflight
from stacks.config import ami_context_key, offerings_context_key

BOOTSTRAP = "/cdk-bootstrap/hnb659fds/version"
AMI = "/test/preflight-context/ami"


def test_an_account_region_without_cdk_bootstrap_fails_with_the_command_that_fixes_it(aws_env):
    """CDK Developer Guide, "Bootstrapping": `cdk deploy` needs the bootstrap stack, whose version it
    reads from the SSM parameter /cdk-bootstrap/hnb659fds/version (default qualifier); without it
    the deploy stops with "Has the environment been bootstrapped? Please run 'cdk bootstrap'"."""
    fresh = boto3.client("ssm", region_name="ca-central-1")  # a region no test bootstraps
    missing = preflight.bootstrap_check(fresh, ACCOUNT, "ca-central-1")
    assert not missing.ok and missing.name == "CDK bootstrap"
    assert missing.detail == (
        f"{BOOTSTRAP} not found: run `npx cdk bootstrap aws://{ACCOUNT}/ca-central-1` once for this account and region"
    )
    done = boto3.client("ssm", region_name="eu-south-1")
    done.put_parameter(Name=BOOTSTRAP, Value="27", Type="String", Overwrite=True)
    ok = preflight.bootstrap_check(done, ACCOUNT, "eu-south-1")
    assert ok.ok and ok.detail == f"version 27 ({BOOTSTRAP})"
    old = boto3.client("ssm", region_name="eu-central-2")
    old.put_parameter(Name=BOOTSTRAP, Value="5", Type="String", Overwrite=True)
    stale = preflight.bootstrap_check(old, ACCOUNT, "eu-central-2")
    assert not stale.ok and "version 5 is older than the 6 this app's template requires" in stale.detail
    assert f"npx cdk bootstrap aws://{ACCOUNT}/eu-central-2" in stale.detail


REGION = "eu-west-1"


@pytest.fixture
def quiet_region(aws_env, tmp_path):
    """eu-west-1 bootstrapped, the AMI parameter set; returns the env for `fab preflight` there."""
    ssm = boto3.client("ssm", region_name=REGION)
    ssm.put_parameter(Name=BOOTSTRAP, Value="27", Type="String", Overwrite=True)
    ssm.put_parameter(Name=AMI, Value="ami-0aaaaaaaaaaaaaaa1", Type="String", Overwrite=True)
    return dict(
        aws_env,
        AWS_DEFAULT_REGION=REGION,
        AWS_MAX_ATTEMPTS="1",
        GPU_CLUSTER_CDK_CONTEXT=str(tmp_path / "cdk.context.json"),
    )


def test_preflight_takes_cdk_deploys_context_and_says_what_it_checked(quiet_region, tmp_path):
    """The same -c KEY=VALUE as `cdk deploy` (CDK Developer Guide, "Context values": cdk.json, then
    cdk.context.json, then --context on the command line), parsed by the same ClusterConfig."""
    result = run_fab(
        "preflight",
        "-c",
        "instance_type=g5.xlarge",
        "--context",
        "nodes=3",
        "-c",
        f"ami_ssm_parameter={AMI}",
        **quiet_region,
    )
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"checking 3 x g5.xlarge (On-Demand) in {REGION}")
    saved = json.loads((tmp_path / "cdk.context.json").read_text())
    zone = saved[offerings_context_key(REGION, "g5.xlarge")][0]
    assert f"in {REGION}, AZ {zone}" in lines[0]
    assert any(line.startswith("ok    CDK bootstrap: version 27") for line in lines), result.stdout
    bad = run_fab("preflight", "-c", "nodes=abc", **quiet_region)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: invalid config nodes='abc'")
    no_value = run_fab("preflight", "-c", "nodes", **quiet_region)
    assert no_value.returncode == 1 and no_value.stderr.strip() == (
        "error: invalid -c 'nodes': expected KEY=VALUE, as with `cdk deploy -c`"
    )


def test_the_ami_is_pinned_once_and_replaced_only_on_request(quiet_region, tmp_path):
    """A DLAMI's .../latest/ami-id parameter moves at every release; the stack boots the id pinned in
    cdk.context.json (key ami_context_key), so a release replaces no node until --refresh-ami."""
    key = ami_context_key(REGION, AMI)
    args = ("preflight", "-c", f"ami_ssm_parameter={AMI}")
    first = run_fab(*args, **quiet_region)
    assert "ok    AMI: pinned ami-0aaaaaaaaaaaaaaa1" in first.stdout, first.stdout + first.stderr
    assert json.loads((tmp_path / "cdk.context.json").read_text())[key] == "ami-0aaaaaaaaaaaaaaa1"
    boto3.client("ssm", region_name=REGION).put_parameter(
        Name=AMI, Value="ami-0bbbbbbbbbbbbbbb2", Type="String", Overwrite=True
    )  # a new DLAMI release
    kept = run_fab(*args, **quiet_region)
    assert "ok    AMI: ami-0aaaaaaaaaaaaaaa1, pinned in cdk.context.json" in kept.stdout
    assert "ami-0bbbbbbbbbbbbbbb2 is newer: `fab preflight --refresh-ami` pins it" in kept.stdout
    assert json.loads((tmp_path / "cdk.context.json").read_text())[key] == "ami-0aaaaaaaaaaaaaaa1"
    refreshed = run_fab(*args, "--refresh-ami", **quiet_region)
    assert (
        "ok    AMI: ami-0aaaaaaaaaaaaaaa1 -> ami-0bbbbbbbbbbbbbbb2: the next `cdk deploy` replaces every node"
        in refreshed.stdout
    )
    assert json.loads((tmp_path / "cdk.context.json").read_text())[key] == "ami-0bbbbbbbbbbbbbbb2"


def test_preflight_uses_the_region_the_cdk_cli_deploys_to(monkeypatch):
    """Found by a read of the real path: the CDK CLI takes AWS_REGION (then AMAZON_REGION) before
    AWS_DEFAULT_REGION and the profile (aws-cdk's region lookup); botocore reads only
    AWS_DEFAULT_REGION. With both set differently, preflight pinned the AZ and AMI under the other
    region and synth kept refusing."""
    from clusterops.aws.session import aws_session

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert aws_session().region_name == "eu-west-1"
    monkeypatch.delenv("AWS_REGION")
    assert aws_session().region_name == "us-east-1"
    assert aws_session("ap-south-1").region_name == "ap-south-1"
