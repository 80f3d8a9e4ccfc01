"""What the cluster costs now, as the laptop sees it: a boto3 session in the cluster's region, the node price
(the one `fab inventory` kept, else the offline table's; a budget's Spot ceiling), the nodes that bill, the EFS
I/O rate, and a running job's projection. Read by fab train's budget (trainlaunch), fab cost, runs and plan."""

from __future__ import annotations

import os
from typing import Callable, Optional

from . import cost as costs
from .instances import spot_interrupted
from .inventory import Inventory, describe


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


def nodes_zone(session, inv: Optional[Inventory]) -> Optional[str]:
    """The AZ the inventory's nodes run in (Spot prices are per AZ); None without AWS nodes."""
    ids = [n.instance_id for n in inv.nodes if n.instance_id] if inv and inv.source == "aws" else []
    if not ids:
        return None
    zones = [i["Placement"]["AvailabilityZone"] for i in describe(session.client("ec2"), ids).values()]
    return zones[0] if zones else None


def kept_price(inv: Optional[Inventory], instance_type: str) -> Optional[costs.Price]:
    """The price `fab inventory` kept, if it is for this type."""
    if inv is None or inv.usd_per_hour is None or inv.instance_type != instance_type:
        return None
    return costs.Price(inv.usd_per_hour, inv.price_source)


def node_price(inv: Inventory) -> costs.Price:
    """The inventory's node price: the one `fab inventory` kept, else the offline table's."""
    return kept_price(inv, inv.instance_type) or costs.offline_price(inv.instance_type, inv.region or "us-east-1")


def pricing_client(session):
    from botocore.config import Config

    return session.client(
        "pricing",
        region_name="us-east-1",
        config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}),
    )


def budget_price(inv: Inventory, session=None) -> costs.Price:
    """The node price a --budget-usd meters at: node_price, but on a Spot cluster on AWS the most a Spot
    node-hour can cost (its max price, else On-Demand), not the Spot price `fab inventory` saw."""
    from botocore.exceptions import BotoCoreError, ClientError

    if inv.source != "aws" or not inv.spot:
        return node_price(inv)
    region, ids = inv.region or "us-east-1", [n.instance_id for n in inv.nodes if n.instance_id]
    try:
        session = session or aws_session(inv.region)
        ec2, pricing = session.client("ec2"), pricing_client(session)
    except (BotoCoreError, ClientError):
        ec2 = pricing = None
    return costs.spot_ceiling(ec2, pricing, inv.instance_type, region, ids)


def billed_nodes(inv: Inventory, session=None) -> int:
    """The cluster's nodes that bill: all but a Spot node EC2 interrupted and still holds stopped (only EC2
    starts it again; a stopped instance bills no usage); all when EC2 cannot say: the safe side of a budget."""
    from botocore.exceptions import BotoCoreError, ClientError

    ids = [n.instance_id for n in inv.nodes if n.instance_id]
    if inv.source != "aws" or not ids:
        return len(inv.nodes)
    try:
        return len(inv.nodes) - len(spot_interrupted(describe((session or aws_session(inv.region)).client("ec2"), ids)))
    except (BotoCoreError, ClientError):
        return len(inv.nodes)


def efs_io_rate(inv: Inventory, session=None) -> Optional[float]:
    """EFS Elastic-throughput dollars per hour at the last hour's rate; None when unknown."""
    from botocore.exceptions import BotoCoreError, ClientError

    if inv.source != "aws" or not inv.file_system_id:
        return None
    try:
        cloudwatch = (session or aws_session(inv.region)).client("cloudwatch")
        return costs.efs_io_usd_per_hour(cloudwatch, inv.file_system_id)
    except (BotoCoreError, ClientError):
        return None


def projector(inv: Inventory, say: Callable[[str], None] = lambda line: print(line, flush=True)):
    """On AWS: say once what the run will cost (nodes and EFS I/O), as soon as its step time is
    known; "unknown" where no price is known, never an exception after the run has started."""
    if inv.source != "aws":
        return None
    price = node_price(inv)
    hourly = None if price.usd_per_hour is None else price.usd_per_hour * len(inv.nodes)
    printed: list[str] = []

    def on_progress(progress: dict) -> None:
        if printed or not costs.projection(progress, hourly):
            return
        line = costs.projection(progress, hourly, efs_io_rate(inv)) or ""
        say(f"cost: {line} [{price.source}]")
        printed.append(line)

    return on_progress
