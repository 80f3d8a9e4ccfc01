"""The app through the pinned CDK CLI, offline: template facts, cfn-lint, cdk-nag, bad input."""

import json
import subprocess

import pytest
from conftest import REPO, tool_env

# What `fab preflight` pins in cdk.context.json (the AZ that offers the type, the DLAMI's id), given
# explicitly: synth refuses to guess either (issue 19 §4, §13).
AMI = ["-c", "ami_id=ami-0123456789abcdef0"]
PINS = ["-c", "availability_zone=us-east-1a", *AMI]
CASES = {
    "three-nodes": ["-c", "nodes=3", "-c", "ssh_cidr=203.0.113.0/24", *PINS],
    "eight-nodes-retained-existing-vpc": [
        "-c",
        "nodes=8",
        "-c",
        "ssh_cidr=198.51.100.7/32",
        "-c",
        "retain_data=true",
        "-c",
        "vpc_id=vpc-0123456789abcdef0",
        "-c",
        "subnet_id=subnet-0123456789abcdef0",
        "-c",
        "availability_zone=us-east-1a",
        "-c",
        "instance_type=p4d.24xlarge",
        *AMI,
    ],
    # efa=on: auto leaves g5 on TCP (no GPUDirect RDMA); this case keeps a one-card EFA layout in the template
    "ssm-private": [
        "-c",
        "access=ssm",
        "-c",
        "private_subnet=true",
        "-c",
        "instance_type=g5.12xlarge",
        "-c",
        "efa=on",
        *PINS,
    ],
    "p5-efa": [
        "-c",
        "access=ssm",
        "-c",
        "private_subnet=true",
        "-c",
        "instance_type=p5.48xlarge",
        "-c",
        "efa=on",
        *PINS,
    ],
    "spot": [
        "-c",
        "spot=true",
        "-c",
        "spot_max_price=4.5",
        "-c",
        "instance_type=g5.2xlarge",
        "-c",
        "ssh_cidr=203.0.113.0/24",
        *PINS,
    ],
}


def _app_without_cache(tmp_path):
    """The app without the checkout's cdk.context.json (where `fab preflight` may have pinned an AZ
    and an AMI on this machine): what a fresh clone synthesizes."""
    app = tmp_path / "app"
    app.mkdir()
    for name in ("app.py", "cdk.json", "stacks", "assets", ".venv", "node_modules"):
        (app / name).symlink_to(REPO / name)
    return app


def cdk(*args: str, cwd=REPO, validated: bool = False) -> subprocess.CompletedProcess:
    """The pinned CLI; `validated`: with aws-cdk-lib's built-in CloudFormation validation, as a user's synth
    runs (the suite's other synths leave it out: conftest.OFFLINE_ENV)."""
    return subprocess.run(
        [str(REPO / "node_modules" / ".bin" / "cdk"), *args, "--no-notices"],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=tool_env(CDK_VALIDATION="true" if validated else "false"),
        timeout=300,
    )


# Each case's tests stay on one xdist worker (make test: --dist loadgroup): one synth per case, not per worker.
@pytest.fixture(
    scope="module", params=[pytest.param(case, marks=pytest.mark.xdist_group(f"synth-{case}")) for case in CASES]
)
def synth(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    result = cdk("synth", "-q", "-o", str(out), *CASES[request.param], validated=True)
    assert result.returncode == 0, result.stderr[-3000:]
    template_path = next(out.glob("*.template.json"))
    return request.param, out, template_path, json.loads(template_path.read_text())


def test_template_facts(synth):
    case, out, _, template = synth
    resources = template["Resources"].values()
    instances = [r for r in resources if r["Type"] == "AWS::EC2::Instance"]
    assert (
        len(instances)
        == {"three-nodes": 3, "eight-nodes-retained-existing-vpc": 8, "ssm-private": 2, "p5-efa": 2, "spot": 2}[case]
    )
    efa = [
        i
        for r in resources
        if r["Type"] == "AWS::EC2::LaunchTemplate"
        for i in r["Properties"]["LaunchTemplateData"].get("NetworkInterfaces", [])
        if i.get("InterfaceType") in ("efa", "efa-only")
    ]
    assert len(efa) == len(instances) * {"ssm-private": 1, "p5-efa": 32}.get(case, 0)
    groups = [r for r in resources if r["Type"] == "AWS::EC2::PlacementGroup"]
    if case == "spot":  # EC2 launches no stop-on-interruption Spot instance in a placement group
        assert groups == [] and "PlacementGroupName" not in json.dumps(instances)
    else:
        assert len(groups) == 1 and groups[0]["Properties"]["Strategy"] == "cluster"
    efs = [r for r in resources if r["Type"] == "AWS::EFS::FileSystem"][0]
    assert efs["Properties"]["Encrypted"] is True
    assert efs["DeletionPolicy"] == ("Retain" if "retained" in case else "Delete")
    ingress = [
        rule
        for r in resources
        if r["Type"] == "AWS::EC2::SecurityGroup"
        for rule in r["Properties"].get("SecurityGroupIngress", [])
    ]
    ingress += [r["Properties"] for r in resources if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
    assert ingress and all(rule.get("CidrIp") not in ("0.0.0.0/0",) and "CidrIpv6" not in rule for rule in ingress)
    text = json.dumps(template)
    assert any(
        r["Type"] == "AWS::EC2::SecurityGroupIngress"
        and r["Properties"]["IpProtocol"] == "-1"
        and r["Properties"]["SourceSecurityGroupId"] == r["Properties"]["GroupId"]
        for r in resources
    )
    assert '"HttpTokens": "required"' in text
    # The bootstrap is its own asset beside the template (user data fetches it), named in the node config.
    (script,) = out.glob("asset.*.sh")
    assert "/etc/fstab" in script.read_text() and "4444" in script.read_text() and "/etc/fstab" not in text
    assert f"/{script.name.removeprefix('asset.')}" in text
    markets = [
        r["Properties"]["LaunchTemplateData"].get("InstanceMarketOptions")
        for r in resources
        if r["Type"] == "AWS::EC2::LaunchTemplate"
    ]
    assert len(markets) == len(instances)
    assert all(
        m
        == (
            {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "persistent",
                    "InstanceInterruptionBehavior": "stop",
                    "ValidUntil": "2099-12-31T23:59:59Z",
                    "MaxPrice": "4.5",
                },
            }
            if case == "spot"
            else None
        )
        for m in markets
    )


def test_cfn_lint_is_clean(synth):
    _, _, template_path, _ = synth
    result = subprocess.run(
        ["cfn-lint", str(template_path)], capture_output=True, text=True, env=tool_env(), timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_builtin_cloudformation_validation_finds_nothing(synth):
    """aws-cdk-lib validates every template a user synthesizes; its findings would only warn there."""
    _, out, _, _ = synth
    report = json.loads((out / "validation-report.json").read_text())
    [builtin] = [p for p in report["pluginReports"] if p["pluginName"] == "CloudFormation Validate"]
    assert builtin["conclusion"] == "success" and builtin["violations"] == [], builtin["violations"]


@pytest.mark.parametrize("pack", ["AwsSolutions", "NIST.800.53.R5"])
def test_cdk_nag_has_no_unacknowledged_findings_and_every_acknowledgement_has_a_reason(synth, pack):
    _, out, _, _ = synth
    report = json.loads((out / "validation-report.json").read_text())
    nag = [p for p in report["pluginReports"] if p["pluginName"] == pack]
    assert nag, f"the {pack} pack did not run"
    assert nag[0]["violations"] == [] and nag[0]["conclusion"] == "success", [
        v["ruleName"] for v in nag[0]["violations"]
    ]
    for suppressed in nag[0].get("suppressedViolations", []):
        assert len(suppressed["reason"]) > 30, suppressed["ruleName"]


# Through the CLI, one value of each kind (test_config refuses every bad value in process, with the same
# ConfigError and one line); each of these is a CLI, an app and a jsii runtime started: ~5 CPU-seconds.
@pytest.mark.parametrize(
    "args, key",
    [
        (["-c", "ssh_cidr=0.0.0.0/0"], "ssh_cidr"),
        (["-c", "spot=true", "-c", "spot_max_price=0"], "spot_max_price"),
    ],
)
def test_bad_context_stops_synth_with_one_line(args, key, tmp_path):
    result = cdk("synth", "-q", "-o", str(tmp_path), *args, cwd=_app_without_cache(tmp_path))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: invalid config")]
    assert len(errors) == 1 and f" {key}=" in errors[0], result.stderr[-2000:]
    assert not list(tmp_path.glob("*.template.json"))
    # Nothing before the error: no Node end-of-life banner (printed as Python bytes), no npm warning.
    noise = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("b'") or "end-of-life" in line or line.startswith("npm warn")
    ]
    assert not noise, noise[:3]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["-c", "instancetype=g5.xlarge"], "error: unknown context key 'instancetype': did you mean 'instance_type'?"),
    ],
)
def test_a_misspelt_context_key_stops_synth_with_the_closest_key(args, expected, tmp_path):
    """The CDK ignores a context key nothing reads (CDK Developer Guide, "Context values": the app reads
    what it asks for), so `-c nodez=3` built the default 2 nodes without a word (issue 23 §11)."""
    pinned = ["-c", "ssh_cidr=203.0.113.7/32", *PINS]
    result = cdk("synth", "-q", "-o", str(tmp_path), *pinned, *args, cwd=_app_without_cache(tmp_path))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [expected], result.stderr[-2000:]
    assert not list(tmp_path.glob("*.template.json"))


@pytest.mark.parametrize(
    "args, key",
    [
        # access=ssh (the default) that nothing may reach (issue 19 §5)
        (PINS, "ssh_cidr"),
        # no AMI pinned (issue 19 §13): `fab preflight` first (the AZ's refusal is the same annotation:
        # test_config's test_an_unchecked_availability_zone_is_refused_in_one_line)
        (["-c", "ssh_cidr=203.0.113.7/32", "-c", "availability_zone=us-east-1a"], "ami_id"),
    ],
)
def test_what_a_deploy_would_guess_stops_synth_in_one_line(args, key, tmp_path):
    """An error annotation: the CLI fails synth, diff and deploy on it (`validateStacks`), with the
    line that says what to run."""
    result = cdk("synth", "-q", "-o", str(tmp_path), *args, cwd=_app_without_cache(tmp_path))
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if f"error: {key} not set: " in line]
    assert len(errors) == 1 and ("fab preflight" in errors[0] or "ssh_cidr=" in errors[0]), result.stderr[-2000:]
    assert not [line for line in result.stderr.splitlines() if "AwsSolutions-" in line or "NIST" in line]


@pytest.mark.slow
def test_cdk_destroy_needs_none_of_the_deploys_values(moto_env, tmp_path):
    """The CDK CLI runs the app for `cdk destroy` too (aws-cdk's `_destroyWithAction` synthesizes
    without `validateStacks`): tearing a cluster down must work with no `-c` value, no cached AZ and
    no pinned AMI, or a user whose IP changed leaves a cluster billing. Against the moto server: the
    CLI gets past synth to CloudFormation with the stack the cluster's name gives."""
    result = subprocess.run(
        [
            str(REPO / "node_modules" / ".bin" / "cdk"),
            "destroy",
            "--force",
            "--no-notices",
            "-o",
            str(tmp_path / "out"),
            "-c",
            "cluster_name=destroy-probe",  # not test_moto's stack, which the same moto server may hold
        ],
        cwd=_app_without_cache(tmp_path),
        capture_output=True,
        text=True,
        env=tool_env(**moto_env),
        timeout=300,
    )
    assert "not set" not in result.stderr and "invalid config" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 0, result.stderr[-2000:]
    assert "GpuCluster-destroy-probe" in result.stderr + result.stdout
