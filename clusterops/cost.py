"""What the cluster costs: on-demand $/hour (Pricing API, else the dated offline table), storage per
month, a run's projection from its measured step time, and what has been spent since launch."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

TABLE = json.loads((Path(__file__).with_name("prices.json")).read_text())
HOURS_PER_MONTH = 730
# The Pricing API names regions by location.
LOCATIONS = {"us-east-1": "US East (N. Virginia)", "us-east-2": "US East (Ohio)", "us-west-2": "US West (Oregon)",
             "eu-west-1": "EU (Ireland)", "eu-central-1": "EU (Frankfurt)", "ap-northeast-1": "Asia Pacific (Tokyo)"}


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    source: str


def instance_price(pricing, instance_type: str, region: str) -> Price:
    """On-demand Linux price from the Pricing API; the offline table when the API is unavailable."""
    if pricing is not None and region in LOCATIONS:
        try:
            response = pricing.get_products(ServiceCode="AmazonEC2", MaxResults=10, Filters=[
                {"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in (
                    ("instanceType", instance_type), ("location", LOCATIONS[region]),
                    ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"),
                    ("capacitystatus", "Used"))])
            for item in response["PriceList"]:
                product = json.loads(item) if isinstance(item, str) else item
                for term in product["terms"]["OnDemand"].values():
                    for dimension in term["priceDimensions"].values():
                        usd = float(dimension["pricePerUnit"]["USD"])
                        if usd > 0:
                            return Price(usd, "Pricing API")
        except Exception:  # noqa: BLE001 - no access, no network: fall back to the table
            pass
    table = TABLE["instances_usd_per_hour"]
    if instance_type not in table:
        raise KeyError(f"no price for {instance_type}: the Pricing API was unavailable and the offline "
                       f"table ({TABLE['date']}) does not list it")
    return Price(table[instance_type], f"offline table of {TABLE['date']} ({TABLE['region']})")


@dataclass(frozen=True)
class Estimate:
    nodes: int
    node_price: Price
    root_gb: int
    efs_gb: float

    @property
    def usd_per_hour(self) -> float:
        return self.nodes * self.node_price.usd_per_hour

    @property
    def ebs_usd_per_month(self) -> float:
        return self.nodes * self.root_gb * TABLE["gp3_usd_per_gb_month"]

    @property
    def efs_usd_per_month(self) -> float:
        return self.efs_gb * TABLE["efs_standard_usd_per_gb_month"]

    def lines(self) -> list[str]:
        return [f"cluster: {self.nodes} x ${self.node_price.usd_per_hour:.3f}/h = ${self.usd_per_hour:.2f}/hour "
                f"(${self.usd_per_hour * 24:.2f}/day) [{self.node_price.source}]",
                f"EBS root volumes: {self.nodes} x {self.root_gb} GB gp3 = ${self.ebs_usd_per_month:.2f}/month "
                "while the stack exists",
                f"EFS /data: {self.efs_gb:.1f} GB = ${self.efs_usd_per_month:.2f}/month until deleted"]


def projection(progress: dict, usd_per_hour: float) -> Optional[str]:
    """Time and dollars to reach max steps from the measured step time, or None before it is known."""
    step, total, step_time = progress.get("step"), progress.get("max_steps"), progress.get("avg_step_time_s")
    if not step or not total or not step_time:
        return None
    hours = max(0, total - step) * step_time / 3600
    return (f"run: step {step}/{total} at {step_time:.2f} s/step -> {hours:.1f} h and "
            f"${hours * usd_per_hour:.2f} more to reach {total} steps")


def spent(launch_times: list[datetime], usd_per_hour_per_node: float, now: Optional[datetime] = None) -> float:
    now = now or datetime.now(timezone.utc)
    return sum(max(0.0, (now - t).total_seconds()) / 3600 for t in launch_times) * usd_per_hour_per_node
