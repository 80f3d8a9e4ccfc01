"""What the cluster costs: on-demand $/hour (Pricing API by regionCode, else the dated offline table,
labelled) or the Spot price in effect, storage per month, EFS Elastic-throughput I/O, a run's
projection from its measured step time, and what has been spent since launch. A price nobody knows
is "unknown", never $0."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from cluster_node.protocol.rundir import Progress
from cluster_node.supervisor import efsio

TABLE = json.loads((Path(__file__).with_name("prices.json")).read_text())
HOURS_PER_MONTH = 730
# The product the cluster runs: Linux, shared tenancy, no pre-installed software, on-demand capacity.
# Without marketoption the query also matches Capacity Block products, without operation the
# Linux-with-SQL variants (RunInstances:0200 etc.), without licenseModel the BYOL ones.
PRODUCT_FILTERS = (
    ("operatingSystem", "Linux"),
    ("tenancy", "Shared"),
    ("preInstalledSw", "NA"),
    ("capacitystatus", "Used"),
    ("marketoption", "OnDemand"),
    ("operation", "RunInstances"),
    ("licenseModel", "No License required"),
)


class PricingError(ValueError):
    """The Price List API named no single product: its price is not ours to guess."""


@dataclass(frozen=True)
class Price:
    usd_per_hour: Optional[float]  # None: unknown
    source: str

    @property
    def from_api(self) -> bool:
        return self.source.startswith("Pricing API")


def usd(value: Optional[float]) -> str:
    return "unknown" if value is None else f"${value:,.2f}"


def table_line() -> str:
    return (
        f"offline price table: prices of {TABLE['date']} in {TABLE['region']}, checked {TABLE['checked']}; "
        f"source: {TABLE['source']}"
    )


def api_price(pricing, instance_type: str, region: str) -> Optional[float]:
    """On-demand $/hour from the Price List API, filtered by the region's code (e.g. eu-west-1);
    None when no product matches, PricingError when several do (the filters no longer pin one)."""
    filters = [("instanceType", instance_type), ("regionCode", region), *PRODUCT_FILTERS]
    response = pricing.get_products(
        ServiceCode="AmazonEC2",
        MaxResults=10,
        Filters=[{"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in filters],
    )
    products = [json.loads(item) if isinstance(item, str) else item for item in response["PriceList"]]
    if len(products) > 1 or response.get("NextToken"):
        raise PricingError(
            f"{len(products)}{'+' if response.get('NextToken') else ''} products match {instance_type} in {region}"
        )
    for product in products:
        for term in product["terms"].get("OnDemand", {}).values():
            for dimension in term["priceDimensions"].values():
                value = float(dimension["pricePerUnit"].get("USD", 0))
                if value > 0:
                    return value
    return None


def offline_price(instance_type: str, region: str) -> Price:
    value = TABLE["instances_usd_per_hour"].get(instance_type)
    if value is None:
        return Price(None, f"unknown: no Pricing API answer and {instance_type} is not in the offline table")
    where = (
        f"offline table of {TABLE['date']}"
        if region == TABLE["region"]
        else f"offline table of {TABLE['date']}: {TABLE['region']} prices, {region} may differ"
    )
    return Price(value, where)


def instance_price(pricing, instance_type: str, region: str, kept: Optional[Price] = None) -> Price:
    """The Pricing API's price for this region; else a price kept from it earlier (the inventory's);
    else the offline table, labelled with its date and region."""
    why = ""
    if pricing is not None:
        try:
            value = api_price(pricing, instance_type, region)
            if value:
                return Price(value, f"Pricing API, {region}")
        except (ClientError, BotoCoreError):  # no access, no network: fall back
            pass
        except PricingError as error:
            why = f" (Pricing API: {error})"
    if kept is not None and kept.usd_per_hour is not None:
        return kept
    fallback = offline_price(instance_type, region)
    return replace(fallback, source=fallback.source + why)


# What a Linux node's Spot price is listed under (accounts from the EC2-Classic era also see the VPC one).
SPOT_PRODUCTS = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")


def spot_price(ec2, instance_type: str, zone: Optional[str] = None, now: Optional[datetime] = None) -> Price:
    """The Spot price in effect now for the type in the AZ, or in the cheapest AZ when none is given.
    With StartTime = EndTime = now, describe_spot_price_history returns the last change before now,
    the price in effect (EC2 API reference, DescribeSpotPriceHistory)."""
    now = now or datetime.now(timezone.utc)
    params = dict(InstanceTypes=[instance_type], ProductDescriptions=list(SPOT_PRODUCTS), StartTime=now, EndTime=now)
    if zone:
        params["AvailabilityZone"] = zone
    latest: dict[str, dict] = {}
    for page in ec2.get_paginator("describe_spot_price_history").paginate(**params):
        for item in page["SpotPriceHistory"]:
            where = item["AvailabilityZone"]
            if item["InstanceType"] != instance_type or (zone and where != zone):
                continue
            if where not in latest or item["Timestamp"] > latest[where]["Timestamp"]:
                latest[where] = item
    if not latest:
        return Price(None, f"unknown: no Spot price for {instance_type} in {zone or 'any AZ of this region'}")
    best = min(latest.values(), key=lambda item: float(item["SpotPrice"]))
    where = best["AvailabilityZone"] + ("" if zone else ", the cheapest AZ")
    return Price(float(best["SpotPrice"]), f"Spot price, {where}, since {best['Timestamp']:%Y-%m-%d %H:%M} UTC")


def spot_ceiling(ec2, pricing, instance_type: str, region: str, instance_ids: list[str]) -> Price:
    """The most a Spot node-hour can cost, for a budget's meter (the Spot price moves while the run goes, and
    the one `fab inventory` kept may be weeks old): the max price of the nodes' Spot requests (spot_max_price,
    read from EC2; EC2 API reference, SpotInstanceRequest.SpotPrice: "the maximum price per unit hour"), else
    the On-Demand price, which caps what a Spot node with no max price pays."""
    found: list[float] = []
    try:
        if ec2 is not None and instance_ids:
            pages = ec2.get_paginator("describe_spot_instance_requests").paginate(
                Filters=[{"Name": "instance-id", "Values": instance_ids}]
            )
            found = [float(r["SpotPrice"]) for p in pages for r in p["SpotInstanceRequests"] if r.get("SpotPrice")]
    except (ClientError, BotoCoreError, ValueError):
        found = []
    if found:
        return Price(max(found), "the nodes' Spot max price (spot_max_price): the most a node-hour costs")
    on_demand = instance_price(pricing, instance_type, region)
    return replace(on_demand, source=f"On-Demand: the most a Spot node with no max price costs; {on_demand.source}")


def spot_saving(spot: Price, on_demand: Price) -> str:
    """One line: the Spot price against the On-Demand one, and the saving per node-hour."""
    if spot.usd_per_hour is None or on_demand.usd_per_hour is None:
        return (
            f"Spot {usd(spot.usd_per_hour)}/h [{spot.source}] vs On-Demand {usd(on_demand.usd_per_hour)}/h: "
            "saving unknown"
        )
    saving = 1 - spot.usd_per_hour / on_demand.usd_per_hour
    return (
        f"Spot ${spot.usd_per_hour:.4f}/h [{spot.source}] vs On-Demand ${on_demand.usd_per_hour:.4f}/h "
        f"[{on_demand.source}]: {saving:.0%} less per node-hour (Spot prices move; EC2 may interrupt)"
    )


def node_price(
    ec2,
    pricing,
    instance_type: str,
    region: str,
    spot: bool = False,
    zone: Optional[str] = None,
    kept: Optional[Price] = None,
) -> tuple[Price, Optional[str]]:
    """What a node-hour is projected at, and with Spot the saving line. On-Demand: instance_price.
    Spot: the price in effect in `zone` (else the cheapest AZ); when it cannot be read, the On-Demand
    price, the most a Spot node costs without spot_max_price, labelled so."""
    on_demand = instance_price(pricing, instance_type, region, kept=None if spot else kept)
    if not spot:
        return on_demand, None
    try:
        price = spot_price(ec2, instance_type, zone) if ec2 else Price(None, "unknown: no AWS region")
    except (ClientError, BotoCoreError) as error:
        price = Price(None, f"unknown: {str(error).splitlines()[0]}")
    line = spot_saving(price, on_demand)
    if price.usd_per_hour is None:
        price = Price(on_demand.usd_per_hour, f"Spot price unknown, priced at On-Demand: {on_demand.source}")
    return price, line


def efs_io_usd(read_gb: float, write_gb: float) -> float:
    return read_gb * TABLE["efs_elastic_read_usd_per_gb"] + write_gb * TABLE["efs_elastic_write_usd_per_gb"]


def efs_io_gb(cloudwatch, file_system_id: str, start: datetime, end: datetime) -> tuple[float, float]:
    """GB read and written through EFS between start and end: what Elastic throughput bills, data and
    metadata (the AWS/EFS metrics and their contract: cluster_node/supervisor/efsio.py, the head node's meter too)."""
    return efsio.io_gb(cloudwatch, file_system_id, start, end)


def efs_io_usd_per_hour(cloudwatch, file_system_id: str, now: Optional[datetime] = None) -> float:
    """EFS I/O dollars per hour at the last hour's rate."""
    now = now or datetime.now(timezone.utc)
    return efs_io_usd(*efs_io_gb(cloudwatch, file_system_id, now - timedelta(hours=1), now))


# What the watchdog publishes per GPU node (cluster_node/daemons/autostop/watchdog.py publish: Busy, GPUUtilization,
# GPUMemoryUsedPercent), once a minute in one PutMetricData call.
GUARD_METRICS_PER_NODE = 3
PUTS_PER_NODE_MONTH = 60 * HOURS_PER_MONTH


def guards_usd_per_month(nodes: int, flow_log_key: bool = True) -> tuple[float, float]:
    """What the cost guards bill, before CloudWatch's account-wide free tier (10 metrics, 10 alarms,
    3 dashboards, 1M requests a month): (per node-month of running: custom metrics, billed only in
    hours that receive data, and the PutMetricData calls; per month while the stack exists, stopped
    or not: one alarm per node, the flow-log group's KMS key where the stack has one, the dashboard)."""
    running = (
        GUARD_METRICS_PER_NODE * TABLE["custom_metric_usd_per_month"]
        + PUTS_PER_NODE_MONTH / 1000 * TABLE["put_metric_data_usd_per_1000"]
    )
    key = TABLE["kms_key_usd_per_month"] if flow_log_key else 0.0
    standing = nodes * TABLE["alarm_usd_per_month"] + key + TABLE["dashboard_usd_per_month"]
    return running, standing


@dataclass(frozen=True)
class Estimate:
    nodes: int
    node_price: Price
    root_gb: int
    efs_gb: float
    dataset_gb: Optional[float] = None
    epochs: Optional[float] = None
    private_subnet: bool = False
    interface_endpoints: int = 3
    public_ips: int = 0  # the nodes' public IPv4 addresses (access=ssh), billed while they run
    flow_log_key: bool = True  # the stack's own VPC logs rejected flows under its own KMS key (flow_logs=true)

    @property
    def network_usd_per_month(self) -> float:
        """A private subnet's NAT gateway, its Elastic IP (a public IPv4 address) and the Session
        Manager endpoints (one AZ), before data."""
        if not self.private_subnet:
            return 0.0
        hourly = (
            TABLE["nat_gateway_usd_per_hour"]
            + TABLE["public_ipv4_usd_per_hour"]
            + self.interface_endpoints * TABLE["interface_endpoint_usd_per_hour"]
        )
        return hourly * HOURS_PER_MONTH

    @property
    def usd_per_hour(self) -> Optional[float]:
        price = self.node_price.usd_per_hour
        return None if price is None else self.nodes * price

    @property
    def ebs_usd_per_month(self) -> float:
        return self.nodes * self.root_gb * TABLE["gp3_usd_per_gb_month"]

    @property
    def stored_gb(self) -> float:
        """/data's size: what EFS holds now, or the data set where that is larger (before `fab data`, before a
        deploy: the data set then lives on /data)."""
        return max(self.efs_gb, self.dataset_gb or 0.0)

    @property
    def efs_usd_per_month(self) -> float:
        return self.stored_gb * TABLE["efs_standard_usd_per_gb_month"]

    def lines(self) -> list[str]:
        hourly = self.usd_per_hour
        node = usd(self.node_price.usd_per_hour) if hourly is None else f"${self.node_price.usd_per_hour:.3f}"
        lines = [
            f"cluster: {self.nodes} x {node}/h = {usd(hourly)}/hour "
            f"({usd(None if hourly is None else hourly * 24)}/day) [{self.node_price.source}]",
            f"EBS root volumes: {self.nodes} x {self.root_gb} GB gp3 = ${self.ebs_usd_per_month:.2f}/month "
            "while the stack exists",
            f"EFS /data: {self.stored_gb:.1f} GB{' (the data set)' if self.stored_gb > self.efs_gb else ''} = "
            f"${self.efs_usd_per_month:.2f}/month until deleted",
        ]
        if self.private_subnet:
            lines.append(
                f"private subnet: NAT gateway and its IP + {self.interface_endpoints} Session Manager endpoints = "
                f"${self.network_usd_per_month:.2f}/month while the stack exists, plus "
                f"${TABLE['nat_gateway_usd_per_gb']}/GB through the NAT (the image pull, ~20 GB a node)"
            )
        if self.dataset_gb and self.epochs:
            lines.append(self.efs_io_line(self.dataset_gb, self.epochs))
        if self.public_ips:
            rate = TABLE["public_ipv4_usd_per_hour"]
            lines.append(
                f"public IPv4: {self.public_ips} x ${rate}/h = ${self.public_ips * rate:.3f}/hour more while they run"
            )
        return lines + [self.guards_line()]

    def efs_io_line(self, dataset_gb: float, epochs: float) -> str:
        """Reading the data set from /data every epoch, against staging it to each node's NVMe once; both after
        writing it to /data once (`fab data`)."""
        read_gb, staged_gb = dataset_gb * epochs, self.nodes * dataset_gb
        return (
            f"EFS Elastic I/O: up to {read_gb:,.0f} GB read ({dataset_gb:g} GB x {epochs:g} epochs) and "
            f"{dataset_gb:g} GB written once = ${efs_io_usd(read_gb, dataset_gb):,.2f}; staged to local NVMe, "
            f"{self.nodes} x {dataset_gb:g} GB read once = ${efs_io_usd(staged_gb, dataset_gb):,.2f} "
            f"(${TABLE['efs_elastic_read_usd_per_gb']}/GB read, ${TABLE['efs_elastic_write_usd_per_gb']}/GB written)"
        )

    def guards_line(self) -> str:
        running, standing = guards_usd_per_month(self.nodes, self.flow_log_key)
        key = " flow-log key," if self.flow_log_key else ""
        return (
            f"cost guards (idle alarms, dashboard,{key} watchdog metrics): ${standing:.2f}/month while the "
            f"stack exists + ${running:.2f} per node-month running, before CloudWatch's free tier"
        )


def projection(
    progress: Optional[Progress], usd_per_hour: Optional[float], io_usd_per_hour: Optional[float] = None
) -> Optional[str]:
    """Time and dollars to reach max steps from the measured step time, or None before it is known.
    EFS I/O is projected at its last hour's rate when given."""
    if progress is None:
        return None
    step, total, step_time = progress.step, progress.max_steps, progress.avg_step_time_s
    if not step or not total or not step_time:
        return None
    hours = max(0, total - step) * step_time / 3600
    line = (
        f"run: step {step}/{total} at {step_time:.2f} s/step -> {hours:.1f} h and "
        f"{usd(None if usd_per_hour is None else hours * usd_per_hour)} more for the nodes"
    )
    if io_usd_per_hour is not None:
        line += f" + ${hours * io_usd_per_hour:.2f} EFS I/O at the last hour's rate"
    return line + f" to reach {total} steps"


def spent(
    launch_times: list[datetime], usd_per_hour_per_node: Optional[float], now: Optional[datetime] = None
) -> Optional[float]:
    if usd_per_hour_per_node is None:
        return None
    now = now or datetime.now(timezone.utc)
    return sum(max(0.0, (now - t).total_seconds()) / 3600 for t in launch_times) * usd_per_hour_per_node
