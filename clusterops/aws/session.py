"""The laptop's boto3 session in the cluster's region (one actionable line when the AWS configuration is
broken), the Price List client, and the AZ the inventory's nodes run in."""

from __future__ import annotations

import os
from typing import Optional

from clusterops.inventory import Inventory, describe


class AwsConfigError(RuntimeError):
    """The AWS configuration on this machine is broken (a profile, the credentials file)."""


def aws_session(region=None):
    """A boto3 session, or one actionable line when the AWS configuration is broken."""
    import boto3
    from botocore.exceptions import BotoCoreError

    # The region the CDK CLI deploys to: AWS_REGION, then AMAZON_REGION, before botocore's own
    # AWS_DEFAULT_REGION and profile (aws-cdk's region lookup), so preflight pins for that region.
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AMAZON_REGION") or None
    try:
        session = boto3.session.Session(region_name=region)
        session.get_credentials()
        return session
    except BotoCoreError as error:
        raise AwsConfigError(f"AWS configuration: {error} (check AWS_PROFILE / `aws configure`)") from None


def pricing_client(session):
    from botocore.config import Config

    return session.client(
        "pricing",
        region_name="us-east-1",
        config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}),
    )


def nodes_zone(session, inv: Optional[Inventory]) -> Optional[str]:
    """The AZ the inventory's nodes run in (Spot prices are per AZ); None without AWS nodes."""
    ids = [n.instance_id for n in inv.nodes if n.instance_id] if inv and inv.source == "aws" else []
    if not ids:
        return None
    zones = [i["Placement"]["AvailabilityZone"] for i in describe(session.client("ec2"), ids).values()]
    return zones[0] if zones else None
