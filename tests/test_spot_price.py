"""Spot prices (issue 13, section 3): the price in effect now in the nodes' AZ, the saving against On-Demand,
the Spot preflight and `fab cost` on a Spot cluster; EC2 from a moto server, the price history through
botocore's Stubber."""

from datetime import datetime, timedelta, timezone

import boto3
import pytest
from aws_stubs import aws_inventory, offline, quotas_client, table_price
from botocore.stub import ANY, Stubber
from conftest import moto_instances, run_fab

from clusterops import cost
from clusterops.aws import preflight, quotas
from stacks.config import ClusterConfig

# ---------------------------------------------------------------- Spot (issue 13, section 3)

NOW = datetime(2026, 11, 22, 12, tzinfo=timezone.utc)


def spot_history(*items):
    """describe_spot_price_history's answer: (AZ, type, product, price, hours before NOW) per item."""
    return {
        "SpotPriceHistory": [
            {
                "AvailabilityZone": zone,
                "InstanceType": kind,
                "ProductDescription": product,
                "SpotPrice": price,
                "Timestamp": NOW - timedelta(hours=age),
            }
            for zone, kind, product, price, age in items
        ],
        "NextToken": "",
    }


def spot_client(*responses):
    ec2 = offline("ec2")
    stubber = Stubber(ec2)
    for expected, response in responses:
        stubber.add_response("describe_spot_price_history", response, None if expected is ANY else expected)
    stubber.activate()
    return ec2, stubber


def test_the_spot_price_is_the_one_in_effect_now_in_the_az():
    expected = {
        "InstanceTypes": ["g4dn.2xlarge"],
        "ProductDescriptions": ["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
        "StartTime": NOW,
        "EndTime": NOW,
        "AvailabilityZone": "us-east-1b",
    }
    ec2, stubber = spot_client(
        (
            expected,
            spot_history(
                ("us-east-1b", "g4dn.2xlarge", "Linux/UNIX", "0.301000", 30),  # the change before...
                ("us-east-1b", "g4dn.2xlarge", "Linux/UNIX", "0.225700", 2),  # ...the one in effect now
                ("us-east-1c", "g4dn.2xlarge", "Linux/UNIX", "0.100000", 1),
            ),
        )
    )  # another AZ: not ours
    price = cost.spot_price(ec2, "g4dn.2xlarge", "us-east-1b", now=NOW)
    stubber.assert_no_pending_responses()
    assert price == cost.Price(0.2257, "Spot price, us-east-1b, since 2026-11-22 10:00 UTC")


def test_without_an_az_the_cheapest_az_is_priced_and_named():
    ec2, _ = spot_client(
        (
            ANY,
            spot_history(
                ("us-east-1a", "p5.48xlarge", "Linux/UNIX", "31.5", 5),
                ("us-east-1a", "p5.48xlarge", "Linux/UNIX", "40.0", 1),
                ("us-east-1d", "p5.48xlarge", "Linux/UNIX", "35.25", 3),
            ),
        )
    )
    price = cost.spot_price(ec2, "p5.48xlarge", now=NOW)
    assert price.usd_per_hour == 35.25 and price.source.startswith("Spot price, us-east-1d, the cheapest AZ")
    empty, _ = spot_client((ANY, spot_history()))
    assert cost.spot_price(empty, "p5.48xlarge", "us-east-1a", now=NOW) == cost.Price(
        None, "unknown: no Spot price for p5.48xlarge in us-east-1a"
    )


def test_the_saving_against_on_demand():
    line = cost.spot_saving(cost.Price(0.2257, "Spot price, us-east-1b"), cost.Price(0.752, "Pricing API, us-east-1"))
    assert line.startswith(
        "Spot $0.2257/h [Spot price, us-east-1b] vs On-Demand $0.7520/h [Pricing API, us-east-1]: "
        "70% less per node-hour"
    )
    assert cost.spot_saving(cost.Price(None, "unknown"), cost.Price(0.752, "x")).endswith("saving unknown")


def test_a_spot_price_that_cannot_be_read_prices_nodes_at_on_demand_and_says_so():
    ec2 = offline("ec2")
    with Stubber(ec2) as stubber:
        stubber.add_client_error("describe_spot_price_history", "UnauthorizedOperation", "not allowed")
        price, line = cost.node_price(ec2, None, "g4dn.2xlarge", "us-east-1", spot=True, zone="us-east-1a")
    assert price.usd_per_hour == table_price("g4dn.2xlarge")
    assert price.source.startswith("Spot price unknown, priced at On-Demand: offline")
    assert "UnauthorizedOperation" in line and line.endswith("saving unknown")
    on_demand, none = cost.node_price(None, None, "g4dn.2xlarge", "us-east-1", kept=cost.Price(0.8, "kept"))
    assert (on_demand, none) == (cost.Price(0.8, "kept"), None)


def _spot_config(**context):
    return ClusterConfig.from_context({"spot": "true", "instance_type": "g4dn.2xlarge", **context})


def test_preflight_fails_a_spot_max_price_below_the_spot_price():
    history = spot_history(("us-east-1a", "g4dn.2xlarge", "Linux/UNIX", "0.30", 1))
    ec2, _ = spot_client((ANY, history))
    low = preflight.spot_check(ec2, None, _spot_config(spot_max_price="0.25"), "us-east-1", "us-east-1a")
    assert not low.ok and low.detail.endswith("spot_max_price 0.25 is below it: no node would launch")
    ec2, _ = spot_client((ANY, history))
    enough = preflight.spot_check(ec2, None, _spot_config(spot_max_price="0.35"), "us-east-1", "us-east-1a")
    assert enough.ok and not enough.skipped and "60% less per node-hour" in enough.detail
    denied = offline("ec2")
    with Stubber(denied) as stubber:
        stubber.add_client_error("describe_spot_price_history", "UnauthorizedOperation", "not allowed")
        unread = preflight.spot_check(denied, None, _spot_config(), "us-east-1", "us-east-1a")
    assert unread.ok and unread.skipped and unread.detail.startswith("not checked: UnauthorizedOperation")


def test_full_spot_preflight_against_the_emulator(aws_env, monkeypatch):
    """moto answers describe_spot_price_history (with a made-up price) and the Spot dry run."""
    clients = {name: boto3.client(name) for name in ("sts", "ec2", "ssm", "kms", "cloudformation")}
    # moto has no GetEbsDefaultKmsKeyId: a new account's answer, its AWS managed key
    default_key = {"KmsKeyId": "arn:aws:kms:us-east-1:123456789012:alias/aws/ebs"}
    monkeypatch.setattr(clients["ec2"], "get_ebs_default_kms_key_id", lambda: default_key)
    clients["ssm"].put_parameter(Name="/test/preflight/ami", Value="ami-03cf127a", Type="String", Overwrite=True)
    running = quotas.running_vcpus(clients["ec2"], "g4dn.2xlarge", spot=True)
    clients["service-quotas"], stubber = quotas_client(16 + running, code="L-3819A6DF", vpcs=1000)
    found, _ = preflight.run_preflight(
        clients, "us-east-1", _spot_config(ami_ssm_parameter="/test/preflight/ami"), spot=True
    )
    assert [c.name for c in found] == [
        "credentials",
        "region",
        "CDK bootstrap",
        "deployed cluster",
        "AZ and subnet",
        "vCPU quota (Spot)",
        "VPC quota",
        "Spot price",
        "Spot volume key",
        "AMI",
        "launch permission (RunInstances dry run)",
    ]
    assert all(c.ok for c in found if c.name != "CDK bootstrap"), found
    zone = found[4].detail.split(" in ")[1].split(" ")[0]
    spot = next(c for c in found if c.name == "Spot price")
    assert f"[Spot price, {zone}, since " in spot.detail and "less per node-hour" in spot.detail
    stubber.assert_no_pending_responses()


KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
SPOT_ROLE = "arn:aws:iam::123456789012:role/aws-service-role/spot.amazonaws.com/AWSServiceRoleForEC2Spot"
AWS_EBS = "arn:aws:kms:us-east-1:123456789012:alias/aws/ebs"


@pytest.mark.parametrize(
    "default_key, manager, grantees, ok",
    [
        (AWS_EBS, None, None, True),
        (KEY, "AWS", None, True),
        ("alias/team-ebs", "CUSTOMER", [], False),  # set by alias: the grant must name the key's ARN
        (KEY, "CUSTOMER", ["arn:aws:iam::123456789012:role/other"], False),
        (KEY, "CUSTOMER", [SPOT_ROLE], True),
    ],
    ids=["aws-ebs", "aws-managed", "customer-by-alias", "customer-granted-elsewhere", "customer-granted"],
)
def test_a_customer_managed_default_ebs_key_needs_a_grant_for_the_spot_service_role(default_key, manager, grantees, ok):
    """EC2 restarts an interrupted Spot node through AWSServiceRoleForEC2Spot, which needs a grant on a
    customer managed key (EC2 User Guide, "Service-linked role for Spot Instance requests"); the nodes'
    root volumes use the account's default EBS key. Response shapes from botocore's models."""
    ec2, kms = offline("ec2"), offline("kms")
    with Stubber(ec2) as ec2_stub, Stubber(kms) as kms_stub:
        ec2_stub.add_response("get_ebs_default_kms_key_id", {"KmsKeyId": default_key})
        if manager:
            metadata = {"KeyId": KEY, "Arn": KEY, "KeyManager": manager}
            kms_stub.add_response("describe_key", {"KeyMetadata": metadata}, {"KeyId": default_key})
        if grantees is not None:
            grants = [{"KeyId": KEY, "GranteePrincipal": g} for g in grantees]
            kms_stub.add_response("list_grants", {"Grants": grants, "Truncated": False}, {"KeyId": KEY})
        found = preflight.spot_volume_key(ec2, kms, "123456789012", "us-east-1")
    assert found.name == "Spot volume key" and found.ok == ok, found
    if not ok:
        assert "not granted to the Spot service role: EC2 could not restart an interrupted node" in found.detail
        assert f"aws kms create-grant --region us-east-1 --key-id {KEY} --grantee-principal {SPOT_ROLE}" in found.detail
    denied = offline("ec2")
    with Stubber(denied) as stub:
        stub.add_client_error("get_ebs_default_kms_key_id", "UnauthorizedOperation", "not allowed")
        unread = preflight.spot_volume_key(denied, kms, "123456789012", "us-east-1")
    assert unread.ok and unread.skipped and unread.detail.startswith("not checked: UnauthorizedOperation")


def test_a_spot_dry_run_carries_the_nodes_market_options():
    ec2 = offline("ec2")
    with Stubber(ec2) as stubber:
        stubber.add_client_error(
            "run_instances",
            "DryRunOperation",
            expected_params={
                "ImageId": "ami-1",
                "InstanceType": "g5.xlarge",
                "MinCount": 1,
                "MaxCount": 1,
                "DryRun": True,
                "Placement": {"AvailabilityZone": "us-east-1b"},
                "InstanceMarketOptions": {
                    "MarketType": "spot",
                    "SpotOptions": {"SpotInstanceType": "persistent", "InstanceInterruptionBehavior": "stop"},
                },
            },
        )
        assert preflight.dry_run(ec2, "ami-1", "g5.xlarge", 1, availability_zone="us-east-1b", spot=True).ok


def test_fab_cost_prices_spot_nodes_in_their_az_and_fab_inventory_keeps_that_price(aws_env):
    from clusterops.aws.session import nodes_zone

    session = boto3.session.Session()
    ids = moto_instances(2, "spotcost")
    inv = aws_inventory("spotcost", ids, spot=True)
    zone = nodes_zone(session, inv)
    assert (
        zone
        == boto3.client("ec2").describe_instances(InstanceIds=ids[:1])["Reservations"][0]["Instances"][0]["Placement"][
            "AvailabilityZone"
        ]
    )
    price, line = cost.node_price(session.client("ec2"), None, inv.instance_type, "us-east-1", inv.spot, zone)
    assert price.source.startswith(f"Spot price, {zone}, since ")
    assert f"vs On-Demand ${table_price(inv.instance_type):.4f}/h" in line
    assert nodes_zone(session, None) is None


def test_fab_cost_spot_prices_the_cluster_at_the_spot_price(tmp_path, aws_env):
    result = run_fab(
        "cost",
        "--spot",
        "--nodes",
        "3",
        "--instance-type",
        "g4dn.2xlarge",
        GPU_CLUSTER_INVENTORY=str(tmp_path / "none.json"),
        **aws_env,
    )
    assert result.returncode == 0, result.stderr
    saving, cluster = result.stdout.splitlines()[:2]
    assert saving.startswith("Spot $") and "the cheapest AZ" in saving
    assert f"vs On-Demand ${table_price('g4dn.2xlarge'):.4f}/h" in saving
    assert cluster.startswith("cluster: 3 x $") and "[Spot price, us-east-1" in cluster
