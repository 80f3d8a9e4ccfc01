"""EC2's and the VPC's quotas a cluster uses: the vCPU bucket of its family and purchase option (with
what already runs there, and a request for more), and what a new cluster's own VPC takes. Functions take
boto3 clients; preflight.py prints their lines."""

from __future__ import annotations

from dataclasses import dataclass

from botocore.exceptions import ClientError

from clusterops.aws.check import Check
from stacks.instance_types import INSTANCE_TYPES

# EC2 vCPU quota buckets (Service Quotas, service "ec2"; "Amazon EC2 instance type quotas" in the
# EC2 docs): On-Demand P is one bucket; Spot P5 has its own, apart from P4, P3 and P2.
G_ON_DEMAND = ("L-DB2E81BA", "Running On-Demand G and VT instances")
P_ON_DEMAND = ("L-417A185B", "Running On-Demand P instances")
G_SPOT = ("L-3819A6DF", "All G and VT Spot Instance Requests")
P432_SPOT = ("L-7212CCBC", "All P4, P3 and P2 Spot Instance Requests")
P5_SPOT = ("L-C4BD4855", "All P5 Spot Instance Requests")
# What a new cluster's own VPC takes (AWS General Reference, "Amazon VPC endpoints and quotas"; EC2's):
# (service, quota code, name). 5 each by default; CloudFormation fails the deploy there and rolls back.
VPCS = ("vpc", "L-F678F1CE", "VPCs per Region")
# Raised with VPCs per Region, but counted apart: a gateway left detached by a deleted VPC still counts.
INTERNET_GATEWAYS = ("vpc", "L-A4707A72", "Internet gateways per Region")
ELASTIC_IPS = ("ec2", "L-0263D0A3", "EC2-VPC Elastic IPs")  # private_subnet: the NAT gateway's
NETWORK = "VPC quota"


def quota_bucket(instance_type: str, spot: bool = False) -> tuple[str, str]:
    family = instance_type.split(".")[0]
    if family.startswith(("g", "vt")):
        return G_SPOT if spot else G_ON_DEMAND
    if family.startswith("p") and not spot:
        return P_ON_DEMAND
    if family.startswith("p5"):
        return P5_SPOT
    if family.startswith(("p2", "p3", "p4")):
        return P432_SPOT
    raise ValueError(f"no GPU vCPU quota bucket known for {instance_type} ({'Spot' if spot else 'On-Demand'})")


def _same_bucket(instance_type: str, bucket: tuple[str, str], spot: bool) -> bool:
    try:
        return quota_bucket(instance_type, spot) == bucket
    except ValueError:
        return False


def _lifecycle_matches(instance: dict, spot: bool) -> bool:
    return instance.get("InstanceLifecycle") == "spot" if spot else "InstanceLifecycle" not in instance


def vcpus(ec2, instance_types: set[str]) -> dict[str, int]:
    """vCPUs per type: the instance-type table, describe_instance_types for the others."""
    known = {t: INSTANCE_TYPES[t].vcpus for t in instance_types if t in INSTANCE_TYPES}
    others = sorted(instance_types - set(known))
    if others:
        found = ec2.describe_instance_types(InstanceTypes=others)["InstanceTypes"]
        known.update({t["InstanceType"]: t["VCpuInfo"]["DefaultVCpus"] for t in found})
    return known


def running_vcpus(ec2, instance_type: str, spot: bool = False) -> int:
    """vCPUs already running in the same bucket and purchase option (Spot: InstanceLifecycle
    "spot"; On-Demand: no InstanceLifecycle); they count against the same quota. With Spot, the
    requests not yet fulfilled count too (EC2 User Guide, "Spot Instance quotas")."""
    bucket = quota_bucket(instance_type, spot)
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
    )
    instances = {
        i["InstanceId"]: i["InstanceType"]
        for page in pages
        for r in page["Reservations"]
        for i in r["Instances"]
        if _lifecycle_matches(i, spot) and _same_bucket(i["InstanceType"], bucket, spot)
    }
    types = list(instances.values()) + (_pending_spot_types(ec2, bucket, set(instances)) if spot else [])
    sizes = vcpus(ec2, set(types))
    return sum(sizes.get(t, 0) for t in types)


def _pending_spot_types(ec2, bucket: tuple[str, str], counted: set[str]) -> list[str]:
    """Instance types of open Spot requests (and active ones whose instance is not running, so not
    counted yet) in the bucket: they will use the quota once fulfilled."""
    pages = ec2.get_paginator("describe_spot_instance_requests").paginate(
        Filters=[{"Name": "state", "Values": ["open", "active"]}]
    )
    return [
        r["LaunchSpecification"]["InstanceType"]
        for page in pages
        for r in page["SpotInstanceRequests"]
        if r.get("InstanceId") not in counted and _same_bucket(r["LaunchSpecification"]["InstanceType"], bucket, True)
    ]


@dataclass(frozen=True)
class QuotaCheck:
    code: str
    name: str
    quota: float
    running: int
    requested: int

    @property
    def needed(self) -> int:
        return self.running + self.requested

    @property
    def ok(self) -> bool:
        return self.needed <= self.quota

    def line(self) -> str:
        verdict = "enough" if self.ok else f"short by {self.needed - self.quota:g}"
        return (
            f"{self.name} ({self.code}): quota {self.quota:g} vCPUs; running {self.running} + "
            f"requested {self.requested} = {self.needed}: {verdict}"
        )


def quota_value(quotas, service: str, code: str) -> float:
    """The account's value of a quota; AWS's default where the account has none of its own."""
    try:
        return quotas.get_service_quota(ServiceCode=service, QuotaCode=code)["Quota"]["Value"]
    except ClientError as error:
        if error.response["Error"]["Code"] != "NoSuchResourceException":
            raise
        return quotas.get_aws_default_service_quota(ServiceCode=service, QuotaCode=code)["Quota"]["Value"]


def check_quota(ec2, quotas, instance_type: str, nodes: int, spot: bool = False) -> QuotaCheck:
    code, name = quota_bucket(instance_type, spot)
    per_node = vcpus(ec2, {instance_type})[instance_type]
    quota = quota_value(quotas, "ec2", code)
    return QuotaCheck(code, name, quota, running_vcpus(ec2, instance_type, spot), nodes * per_node)


def network_quota(ec2, quotas, account: str, vpc: bool, elastic_ip: bool) -> Check:
    """What a deploy adds against the region's quotas: a VPC and its internet gateway, a NAT gateway's
    Elastic IP (private subnet). One short fails the deploy minutes in, at that resource, and rolls it
    back. VPCs another account shares with this one count against the owner's quota, not this one's."""
    needs = []
    if vpc:
        needs.append((VPCS, _owned(ec2, "describe_vpcs", "Vpcs", account)))
        needs.append((INTERNET_GATEWAYS, _owned(ec2, "describe_internet_gateways", "InternetGateways", account)))
    if elastic_ip:
        needs.append((ELASTIC_IPS, len(ec2.describe_addresses()["Addresses"])))
    lines, ok = [], True
    for (service, code, name), used in needs:
        quota = quota_value(quotas, service, code)
        ok &= used + 1 <= quota
        lines.append(f"{name} ({code}): {used} of {quota:g} in use, the cluster adds 1")
    if not ok:
        lines.append(
            "none left: free one, raise it (Service Quotas console), or deploy into an existing VPC "
            "(-c vpc_id=... -c subnet_id=...)"
        )
    return Check(NETWORK, ok, "; ".join(lines))


def _owned(ec2, operation: str, key: str, account: str) -> int:
    pages = ec2.get_paginator(operation).paginate()
    return sum(1 for page in pages for item in page[key] if not account or item.get("OwnerId", account) == account)


def request_increase(quotas, check: QuotaCheck) -> str:
    try:
        response = quotas.request_service_quota_increase(
            ServiceCode="ec2", QuotaCode=check.code, DesiredValue=float(check.needed)
        )
    except ClientError as error:
        if error.response["Error"]["Code"] != "ResourceAlreadyExistsException":
            raise
        return (
            f"a request to raise {check.name} ({check.code}) is already open; see the Service Quotas "
            "console (Quota request history) and wait for it, or change it there"
        )
    request = response["RequestedQuota"]
    return (
        f"requested {check.name} = {check.needed} vCPUs (request {request['Id']}, "
        f"status {request['Status']}); approval can take a few days"
    )
