"""AWS stand-ins the preflight, cost and Spot price tests share: botocore Stubbers with real response shapes
for what moto lacks (Service Quotas), an offline client, and an AWS inventory of moto's instances."""

from datetime import datetime, timezone

import boto3
from botocore.stub import Stubber

from clusterops import cost
from clusterops.inventory import Inventory, Node, SshSettings

QUOTA_NAME = "Running On-Demand G and VT instances"


def table_price(instance_type: str) -> float:
    """The offline table's On-Demand price: tests read it, never copy it."""
    return cost.TABLE["instances_usd_per_hour"][instance_type]


def offline(service: str):
    return boto3.client(
        service,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        endpoint_url=f"https://{service}.invalid",
    )


def quotas_client(value: float, code="L-DB2E81BA", request=None, vpcs=None):
    """The vCPU quota `code` at `value`; then, with `vpcs`, VPCs and internet gateways per Region at that
    value (a new cluster's VPC)."""
    client = offline("service-quotas")
    stubber = Stubber(client)
    stubber.add_response(
        "get_service_quota",
        {
            "Quota": {
                "ServiceCode": "ec2",
                "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
                "QuotaArn": f"arn:aws:servicequotas:us-east-1:123456789012:ec2/{code}",
                "QuotaCode": code,
                "QuotaName": QUOTA_NAME,
                "Value": value,
                "Unit": "None",
                "Adjustable": True,
                "GlobalQuota": False,
            }
        },
        {"ServiceCode": "ec2", "QuotaCode": code},
    )
    for network in ("L-F678F1CE", "L-A4707A72") if vpcs is not None else ():
        stubber.add_response(
            "get_service_quota", vpc_quota(vpcs, network), {"ServiceCode": "vpc", "QuotaCode": network}
        )
    if request is not None:
        stubber.add_response(
            "request_service_quota_increase",
            {
                "RequestedQuota": {
                    "Id": "req-0123456789",
                    "CaseId": "case-1",
                    "ServiceCode": "ec2",
                    "QuotaCode": code,
                    "QuotaName": QUOTA_NAME,
                    "DesiredValue": float(request),
                    "Status": "PENDING",
                    "Created": datetime(2026, 11, 22, tzinfo=timezone.utc),
                    "Requester": "me",
                    "QuotaArn": f"arn:aws:servicequotas:us-east-1:123456789012:ec2/{code}",
                    "GlobalQuota": False,
                    "Unit": "None",
                }
            },
            {"ServiceCode": "ec2", "QuotaCode": code, "DesiredValue": float(request)},
        )
    stubber.activate()
    return client, stubber


def vpc_quota(value: float, code: str = "L-F678F1CE", service: str = "vpc") -> dict:
    """GetServiceQuota's answer for a network quota (VPCs per Region by default)."""
    return {
        "Quota": {
            "ServiceCode": service,
            "ServiceName": "Amazon Virtual Private Cloud (Amazon VPC)",
            "QuotaArn": f"arn:aws:servicequotas:us-east-1:123456789012:{service}/{code}",
            "QuotaCode": code,
            "QuotaName": code,
            "Value": value,
            "Unit": "None",
            "Adjustable": True,
            "GlobalQuota": False,
        }
    }


def aws_inventory(cluster: str, ids: list[str], **extra) -> Inventory:
    """An AWS inventory of g4dn.xlarge nodes with these instance ids (moto's)."""
    return Inventory(
        cluster=cluster,
        source="aws",
        gpus_per_node=1,
        instance_type="g4dn.xlarge",
        region="us-east-1",
        nodes=[Node(r, f"node{r}", "1.2.3.4", "10.0.0.5", i) for r, i in enumerate(ids)],
        ssh=SshSettings("root", 4444, "/k", "/kh"),
        **extra,
    )
