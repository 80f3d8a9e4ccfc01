"""Before `cdk deploy`: credentials, region, instance offering, the vCPU quota bucket, a RunInstances
dry run, the AMI parameter; and a quota increase request when asked. Functions take boto3 clients."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from botocore.exceptions import ClientError, NoCredentialsError

# EC2 vCPU quota buckets by instance family (Service Quotas codes, service "ec2").
ON_DEMAND_QUOTAS = {"g": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
                    "vt": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
                    "p": ("L-417A185B", "Running On-Demand P instances")}
SPOT_QUOTAS = {"g": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
               "vt": ("L-3819A6DF", "All G and VT Spot Instance Requests"),
               "p": ("L-7212CCBC", "All P Spot Instance Requests")}
DRY_RUN_ERRORS = {
    "UnauthorizedOperation": "your credentials may not launch instances (ec2:RunInstances)",
    "InsufficientInstanceCapacity": "AWS has no capacity for this type here now: try another AZ or later",
    "VcpuLimitExceeded": "the vCPU quota is too low (see the quota line)",
    "InstanceLimitExceeded": "the instance quota is too low",
    "Unsupported": "this instance type is not supported in this AZ",
    "InvalidAMIID.NotFound": "the AMI does not exist in this region",
    "OptInRequired": "the account must opt in to this region or product",
}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def quota_bucket(instance_type: str, spot: bool = False) -> tuple[str, str]:
    family = instance_type.split(".")[0]
    key = "vt" if family.startswith("vt") else family[0]
    table = SPOT_QUOTAS if spot else ON_DEMAND_QUOTAS
    if key not in table:
        raise ValueError(f"no GPU vCPU quota bucket for {instance_type}")
    return table[key]


def same_bucket(a: str, b: str) -> bool:
    try:
        return quota_bucket(a) == quota_bucket(b)
    except ValueError:
        return False


def vcpus(ec2, instance_types: set[str]) -> dict[str, int]:
    if not instance_types:
        return {}
    found = ec2.describe_instance_types(InstanceTypes=sorted(instance_types))["InstanceTypes"]
    return {t["InstanceType"]: t["VCpuInfo"]["DefaultVCpus"] for t in found}


def running_vcpus(ec2, instance_type: str) -> int:
    """vCPUs already running in the same quota bucket (they count against it)."""
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    types = [i["InstanceType"] for page in pages for r in page["Reservations"] for i in r["Instances"]
             if same_bucket(i["InstanceType"], instance_type)]
    sizes = vcpus(ec2, set(types))
    return sum(sizes[t] for t in types)


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
        return (f"{self.name} ({self.code}): quota {self.quota:g} vCPUs; running {self.running} + "
                f"requested {self.requested} = {self.needed}: {verdict}")


def check_quota(ec2, quotas, instance_type: str, nodes: int, spot: bool = False) -> QuotaCheck:
    code, name = quota_bucket(instance_type, spot)
    per_node = vcpus(ec2, {instance_type})[instance_type]
    try:
        quota = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    except ClientError as error:
        if error.response["Error"]["Code"] != "NoSuchResourceException":
            raise
        quota = quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    return QuotaCheck(code, name, quota, running_vcpus(ec2, instance_type), nodes * per_node)


def request_increase(quotas, check: QuotaCheck) -> str:
    response = quotas.request_service_quota_increase(ServiceCode="ec2", QuotaCode=check.code,
                                                     DesiredValue=float(check.needed))
    request = response["RequestedQuota"]
    return (f"requested {check.name} = {check.needed} vCPUs (request {request['Id']}, "
            f"status {request['Status']}); approval can take a few days")


def dry_run(ec2, image_id: str, instance_type: str, nodes: int, subnet_id: Optional[str] = None) -> Check:
    params = dict(ImageId=image_id, InstanceType=instance_type, MinCount=nodes, MaxCount=nodes, DryRun=True)
    if subnet_id:
        params["SubnetId"] = subnet_id
    try:
        ec2.run_instances(**params)
    except ClientError as error:
        code = error.response["Error"]["Code"]
        if code == "DryRunOperation":
            return Check("RunInstances dry run", True, f"{nodes} x {instance_type} would launch")
        return Check("RunInstances dry run", False,
                     f"{code}: {DRY_RUN_ERRORS.get(code, error.response['Error'].get('Message', ''))}")
    return Check("RunInstances dry run", False, "the dry run launched nothing and raised nothing")


def offered(ec2, instance_type: str) -> Check:
    zones = sorted(o["Location"] for o in ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [instance_type]}])["InstanceTypeOfferings"])
    if zones:
        return Check("offered", True, f"{instance_type} in {', '.join(zones)}")
    return Check("offered", False, f"{instance_type} is not offered in any AZ of this region")


def identity(sts) -> Check:
    try:
        who = sts.get_caller_identity()
    except (ClientError, NoCredentialsError) as error:
        return Check("credentials", False, f"{error}; configure AWS credentials (aws configure / SSO)")
    return Check("credentials", True, f"account {who['Account']} as {who['Arn']}")


def ami(ssm, parameter: str) -> tuple[Check, Optional[str]]:
    try:
        value = ssm.get_parameter(Name=parameter)["Parameter"]["Value"]
    except ClientError as error:
        return Check("AMI parameter", False, f"{parameter}: {error.response['Error']['Code']}"), None
    return Check("AMI parameter", True, f"{parameter} -> {value}"), value


def run_preflight(clients: dict, region: Optional[str], instance_type: str, nodes: int,
                  ami_parameter: str, request_quota: bool = False, spot: bool = False) -> tuple[list[Check], list[str]]:
    """All checks in order; stops early without credentials or region. Returns (checks, notes)."""
    checks = [identity(clients["sts"])]
    if not checks[0].ok:
        return checks, []
    checks.append(Check("region", bool(region), region or "none: set AWS_REGION or `aws configure`"))
    if not region:
        return checks, []
    ec2 = clients["ec2"]
    checks.append(offered(ec2, instance_type))
    quota = check_quota(ec2, clients["service-quotas"], instance_type, nodes, spot)
    checks.append(Check("vCPU quota", quota.ok, quota.line()))
    ami_check, image_id = ami(clients["ssm"], ami_parameter)
    checks.append(ami_check)
    if image_id:
        checks.append(dry_run(ec2, image_id, instance_type, nodes))
    notes = []
    if not quota.ok:
        notes.append(request_increase(clients["service-quotas"], quota) if request_quota else
                     f"run `fab preflight --request-quota` to ask for {quota.needed} vCPUs")
    return checks, notes
