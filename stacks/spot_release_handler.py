"""The Lambda function of stacks/spot_release.py (this file goes inline into the template): when one of
the cluster's Spot nodes is terminated (`cdk destroy`, a replacement, a rollback, a console termination),
cancel its persistent request before EC2 opens it again and launches a node outside the stack."""

from __future__ import annotations

import os
from typing import Any, Optional

import boto3

LIVE = ("open", "active", "disabled")  # the states CancelSpotInstanceRequests accepts


def handler(event: dict, context: Any = None, ec2: Optional[Any] = None) -> list[str]:
    instance_id = event["detail"]["instance-id"]
    ec2 = ec2 or boto3.client("ec2")
    # The requests carry the cluster tag (the launch template's TagSpecifications), not always the instance.
    tag = {"Name": "tag:" + os.environ["CLUSTER_TAG"], "Values": [os.environ["CLUSTER_NAME"]]}
    requests = ec2.describe_spot_instance_requests(Filters=[tag])["SpotInstanceRequests"]
    ids = [r["SpotInstanceRequestId"] for r in requests if r.get("InstanceId") == instance_id and r["State"] in LIVE]
    if ids:
        ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=ids)
    print(f"{instance_id} {event['detail'].get('state')}: cancelled {', '.join(ids) or 'nothing'}")
    return ids
