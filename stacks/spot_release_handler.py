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
    if not ids:  # EC2 may have reopened the request already, without the instance: found by the node's rank
        ids = _reopened(ec2, requests, instance_id)
    if ids:
        ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=ids)
    print(f"{instance_id} {event['detail'].get('state')}: cancelled {', '.join(ids) or 'nothing'}")
    return ids


def _reopened(ec2: Any, requests: list[dict], instance_id: str) -> list[str]:
    """The cluster's live requests holding no instance, for the terminated node's rank (the launch template
    tags both the instance and its request with it); another cluster's node of that rank matches none."""
    rank_tag = os.environ["RANK_TAG"]
    try:
        reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    except Exception:  # noqa: BLE001 - not an instance EC2 still lists: nothing to match
        return []
    tags = {t["Key"]: t["Value"] for r in reservations for i in r["Instances"] for t in i.get("Tags", [])}
    if rank_tag not in tags or tags.get(os.environ["CLUSTER_TAG"]) != os.environ["CLUSTER_NAME"]:
        return []
    return [
        r["SpotInstanceRequestId"]
        for r in requests
        if not r.get("InstanceId")
        and r["State"] in LIVE
        and {t["Key"]: t["Value"] for t in r.get("Tags", [])}.get(rank_tag) == tags[rank_tag]
    ]
