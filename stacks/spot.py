"""Spot nodes: the market options go on each node's own launch template (stacks/node_launch.py;
AWS::EC2::Instance itself has no market options).

EC2 contracts (Amazon EC2 User Guide, "Behavior of Spot Instance interruptions"; API reference,
LaunchTemplateSpotMarketOptionsRequest and SpotMarketOptions):
  * interruption behaviour `stop` needs a `persistent` request (RunInstances accepts `persistent`
    only with `stop` or `hibernate`) and an EBS root volume: every node boots the EBS-backed DLAMI
    from an EBS /dev/sda1, so every accepted type can be stopped; no type falls back to `terminate`.
    A stopped node keeps its EBS root volume (the built image); instance-store NVMe is erased.
  * only a persistent request lets the node be stopped on purpose (autostop, `fab stop-cluster`);
    EC2 restarts an interrupted node itself when capacity returns, in the same AZ.
  * a persistent request from a launch template ends 7 days after launch unless ValidUntil says
    otherwise; after that an interrupted node would not come back, so it is set far ahead.
  * MaxPrice must be above USD 0.001; without it the price is capped at On-Demand.
"""

from __future__ import annotations

from typing import Optional

from aws_cdk import aws_ec2 as ec2

from .config import SPOT_INTERRUPTION, SPOT_REQUEST, price_text

VALID_UNTIL = "2099-12-31T23:59:59Z"


def market_options(max_price: Optional[float]) -> dict:
    """LaunchTemplateData.InstanceMarketOptions for a node."""
    spot = {
        "SpotInstanceType": SPOT_REQUEST,
        "InstanceInterruptionBehavior": SPOT_INTERRUPTION,
        "ValidUntil": VALID_UNTIL,
    }
    if max_price is not None:
        spot["MaxPrice"] = price_text(max_price)
    return {"MarketType": "spot", "SpotOptions": spot}


def make_spot(template: ec2.CfnLaunchTemplate, max_price: Optional[float], tags: dict[str, str]) -> None:
    """Add the market options, and tags for the Spot request (so `fab audit` finds it), to a node's
    launch template."""
    template.add_property_override("LaunchTemplateData.InstanceMarketOptions", market_options(max_price))
    template.add_property_override(
        "LaunchTemplateData.TagSpecifications",
        [
            {
                "ResourceType": "spot-instances-request",
                "Tags": [{"Key": key, "Value": value} for key, value in sorted(tags.items())],
            }
        ],
    )
