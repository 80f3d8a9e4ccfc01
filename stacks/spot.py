"""Spot nodes: the market options go on the launch template CDK gives each node (it makes one per
instance to require IMDSv2; AWS::EC2::Instance itself has no market options).

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

import jsii
from aws_cdk import IAspect
from aws_cdk import aws_ec2 as ec2
from constructs import IConstruct

from .config import SPOT_INTERRUPTION, SPOT_REQUEST

VALID_UNTIL = "2099-12-31T23:59:59Z"


def price_text(usd: float) -> str:
    """0.45 -> "0.45" (MaxPrice is a string; no exponent, no trailing zeros)."""
    return f"{usd:.6f}".rstrip("0").rstrip(".")


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


@jsii.implements(IAspect)
class SpotLaunchTemplate:
    """make_spot on the launch template of the ec2.Instance it is applied to. Runs after CDK's IMDSv2
    aspect, which creates that template at synthesis."""

    def __init__(self, max_price: Optional[float], tags: dict[str, str]):
        self.max_price, self.tags = max_price, tags

    def visit(self, node: IConstruct) -> None:
        if not isinstance(node, ec2.Instance):
            return
        template = node.node.try_find_child("LaunchTemplate")
        if not isinstance(template, ec2.CfnLaunchTemplate):
            raise ValueError(f"{node.node.path}: no IMDSv2 launch template to make Spot (require_imdsv2 is off?)")
        make_spot(template, self.max_price, self.tags)
