"""Preflight and cost: EC2, STS and SSM from a moto server; Service Quotas and Pricing (which moto
lacks) through botocore's Stubber with real response shapes."""
import json
from datetime import datetime, timedelta, timezone

import boto3
import pytest
from botocore.stub import Stubber

from clusterops import cost, preflight

QUOTA_NAME = "Running On-Demand G and VT instances"


def quotas_client(value: float, code="L-DB2E81BA", request=None):
    client = boto3.client("service-quotas", region_name="us-east-1", aws_access_key_id="x",
                          aws_secret_access_key="x", endpoint_url="https://service-quotas.invalid")
    stubber = Stubber(client)
    stubber.add_response("get_service_quota", {"Quota": {
        "ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
        "QuotaArn": f"arn:aws:servicequotas:us-east-1:123456789012:ec2/{code}", "QuotaCode": code,
        "QuotaName": QUOTA_NAME, "Value": value, "Unit": "None", "Adjustable": True, "GlobalQuota": False}},
        {"ServiceCode": "ec2", "QuotaCode": code})
    if request is not None:
        stubber.add_response("request_service_quota_increase", {"RequestedQuota": {
            "Id": "req-0123456789", "CaseId": "case-1", "ServiceCode": "ec2", "QuotaCode": code,
            "QuotaName": QUOTA_NAME, "DesiredValue": float(request), "Status": "PENDING",
            "Created": datetime(2026, 11, 22, tzinfo=timezone.utc), "Requester": "me",
            "QuotaArn": f"arn:aws:servicequotas:us-east-1:123456789012:ec2/{code}", "GlobalQuota": False,
            "Unit": "None"}},
            {"ServiceCode": "ec2", "QuotaCode": code, "DesiredValue": float(request)})
    stubber.activate()
    return client, stubber


@pytest.mark.parametrize("instance_type, code", [
    ("g4dn.2xlarge", "L-DB2E81BA"), ("g5.48xlarge", "L-DB2E81BA"), ("p3.8xlarge", "L-417A185B"),
    ("p4d.24xlarge", "L-417A185B"), ("p5.48xlarge", "L-417A185B")])
def test_each_family_maps_to_its_vcpu_quota_bucket(instance_type, code):
    assert preflight.quota_bucket(instance_type)[0] == code
    assert preflight.quota_bucket(instance_type, spot=True)[0] in ("L-3819A6DF", "L-7212CCBC")


# (moto's instance-type catalogue has no p3 sizes; p4d and p5 stand for the P bucket)
@pytest.mark.parametrize("instance_type, nodes, quota, ok, needed", [
    ("g4dn.2xlarge", 4, 16, False, 32), ("g4dn.2xlarge", 2, 16, True, 16), ("g5.12xlarge", 2, 64, False, 96),
    ("p4d.24xlarge", 2, 192, True, 192), ("p5.48xlarge", 1, 96, False, 192)])
def test_quota_maths_counts_requested_plus_running_in_the_bucket(aws_env, instance_type, nodes, quota, ok, needed):
    ec2 = boto3.client("ec2")
    code = preflight.quota_bucket(instance_type)[0]
    client, stubber = quotas_client(quota, code)
    check = preflight.check_quota(ec2, client, instance_type, nodes)
    running = check.running
    assert check.requested == needed and check.needed == needed + running
    assert check.ok is (needed + running <= quota) and (running > 0 or check.ok is ok)
    assert f"quota {quota:g} vCPUs" in check.line()
    stubber.assert_no_pending_responses()


def test_running_instances_of_the_same_bucket_count_and_others_do_not(aws_env):
    from conftest import moto_instances
    ec2 = boto3.client("ec2")
    before = preflight.running_vcpus(ec2, "g4dn.2xlarge")
    moto_instances(1, instance_type="g5.xlarge")  # 4 vCPUs, G bucket
    moto_instances(1, instance_type="m5.large")   # standard bucket
    assert preflight.running_vcpus(ec2, "g4dn.2xlarge") == before + 4


def test_a_short_quota_is_requested_with_the_exact_number(aws_env):
    ec2 = boto3.client("ec2")
    running = preflight.running_vcpus(ec2, "g4dn.2xlarge")
    client, stubber = quotas_client(8, request=32 + running)
    check = preflight.check_quota(ec2, client, "g4dn.2xlarge", 4)
    text = preflight.request_increase(client, check)
    assert text.startswith(f"requested {QUOTA_NAME} = {32 + running} vCPUs (request req-0123456789, status PENDING)")
    stubber.assert_no_pending_responses()


@pytest.mark.parametrize("code, words", [
    ("UnauthorizedOperation", "ec2:RunInstances"), ("InsufficientInstanceCapacity", "no capacity"),
    ("VcpuLimitExceeded", "vCPU quota"), ("SomethingNew", "the message from AWS")])
def test_dry_run_errors_are_explained(code, words):
    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(ec2)
    stubber.add_client_error("run_instances", service_error_code=code, service_message="the message from AWS")
    with stubber:
        check = preflight.dry_run(ec2, "ami-12345678", "g4dn.2xlarge", 2)
    assert not check.ok and check.detail.startswith(f"{code}: ") and words in check.detail


def test_full_preflight_against_the_emulator(aws_env):
    clients = {name: boto3.client(name) for name in ("sts", "ec2", "ssm")}
    clients["ssm"].put_parameter(Name="/test/preflight/ami", Value="ami-03cf127a", Type="String", Overwrite=True)
    running = preflight.running_vcpus(clients["ec2"], "g4dn.2xlarge")
    clients["service-quotas"], stubber = quotas_client(16 + running)
    found, notes = preflight.run_preflight(clients, "us-east-1", "g4dn.2xlarge", 2, "/test/preflight/ami")
    assert [c.name for c in found] == ["credentials", "region", "offered", "vCPU quota", "AMI parameter",
                                       "RunInstances dry run"]
    assert all(c.ok for c in found), found and notes == []
    clients["service-quotas"], _ = quotas_client(8)
    found, notes = preflight.run_preflight(clients, "us-east-1", "g4dn.2xlarge", 2, "/missing/parameter")
    failed = {c.name for c in found if not c.ok}
    assert failed == {"vCPU quota", "AMI parameter"} and "--request-quota" in notes[0]


PRICE_ITEM = {"product": {"productFamily": "Compute Instance", "attributes": {"instanceType": "g4dn.2xlarge"}},
              "serviceCode": "AmazonEC2", "terms": {"OnDemand": {"ABC.JRTCKXETXF": {"priceDimensions": {
                  "ABC.JRTCKXETXF.6YS6EN2CT7": {"unit": "Hrs", "pricePerUnit": {"USD": "0.7520000000"},
                  "description": "$0.752 per On Demand Linux g4dn.2xlarge Instance Hour"}}}}}}


def test_price_from_the_pricing_api_and_the_offline_fallback():
    pricing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    stubber = Stubber(pricing)
    stubber.add_response("get_products", {"PriceList": [json.dumps(PRICE_ITEM)], "FormatVersion": "aws_v1"})
    with stubber:
        assert cost.instance_price(pricing, "g4dn.2xlarge", "eu-west-1") == cost.Price(0.752, "Pricing API")
    failing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    broken = Stubber(failing)
    broken.add_client_error("get_products", service_error_code="AccessDeniedException")
    with broken:
        offline = cost.instance_price(failing, "p4d.24xlarge", "us-east-1")
    assert offline.usd_per_hour == cost.TABLE["instances_usd_per_hour"]["p4d.24xlarge"]
    assert offline.source.startswith("offline table of ")
    with pytest.raises(KeyError, match="offline table"):
        cost.instance_price(None, "g9.huge", "us-east-1")


def test_estimate_projection_and_spend():
    estimate = cost.Estimate(4, cost.Price(0.752, "Pricing API"), 200, 13.0)
    assert estimate.usd_per_hour == pytest.approx(3.008)
    assert estimate.ebs_usd_per_month == pytest.approx(4 * 200 * 0.08)
    assert estimate.efs_usd_per_month == pytest.approx(13.0 * 0.30)
    line = cost.projection({"step": 1000, "max_steps": 50_000, "avg_step_time_s": 1.71}, estimate.usd_per_hour)
    hours = 49_000 * 1.71 / 3600
    assert f"{hours:.1f} h" in line and f"${hours * 3.008:.2f}" in line
    assert cost.projection({"step": 5, "max_steps": 10}, 3.0) is None
    now = datetime(2026, 11, 22, 12, tzinfo=timezone.utc)
    assert cost.spent([now - timedelta(hours=2), now - timedelta(hours=1)], 0.752, now) == pytest.approx(3 * 0.752)


def test_fab_cost_without_the_pricing_api_uses_the_marked_offline_table(tmp_path):
    import subprocess
    from conftest import REPO, tool_env
    result = subprocess.run(["fab", "cost", "--nodes", "4", "--instance-type", "g5.xlarge"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "none.json"), AWS_ACCESS_KEY_ID="",
                                         AWS_SECRET_ACCESS_KEY="", AWS_CONFIG_FILE=str(tmp_path / "no-config"),
                                         AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials")))
    assert result.returncode == 0, result.stderr
    assert "cluster: 4 x $1.006/h = $4.02/hour" in result.stdout and "[offline table of " in result.stdout
    assert "EBS root volumes: 4 x 200 GB gp3 = $64.00/month" in result.stdout
    bad = subprocess.run(["fab", "cost", "--instance-type", "m5.large"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "none.json")))
    assert bad.returncode == 1 and "invalid config instance_type='m5.large'" in bad.stderr


def test_a_broken_aws_profile_is_one_line(tmp_path):
    import subprocess
    from conftest import REPO, tool_env
    result = subprocess.run(["fab", "preflight"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=tool_env(AWS_PROFILE="no-such-profile", AWS_CONFIG_FILE=str(tmp_path / "none")))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: AWS configuration: The config profile (no-such-profile) could not be found "
        "(check AWS_PROFILE / `aws configure`)"]
