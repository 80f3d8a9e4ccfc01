"""What is left of a cluster after `cdk destroy` (or before): everything tagged gpu-cluster:name=NAME,
and its SSM parameters, with a monthly cost each; and their deletion. Functions take boto3 clients."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .cost import HOURS_PER_MONTH, TABLE

CLUSTER_TAG = "gpu-cluster:name"
PUBLIC_IPV4_USD_PER_HOUR = 0.005
ALARM_USD_PER_MONTH = 0.10


@dataclass(frozen=True)
class Leftover:
    kind: str
    id: str
    detail: str
    usd_per_month: float


def _tag_filter(cluster: str) -> list[dict]:
    return [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]


def find(clients: dict, cluster: str) -> list[Leftover]:
    ec2, efs, ssm, logs, cloudwatch = (clients[k] for k in ("ec2", "efs", "ssm", "logs", "cloudwatch"))
    found: list[Leftover] = []
    prices = TABLE["instances_usd_per_hour"]
    for reservation in ec2.describe_instances(Filters=_tag_filter(cluster))["Reservations"]:
        for i in reservation["Instances"]:
            state = i["State"]["Name"]
            if state in ("terminated", "shutting-down"):
                continue
            monthly = prices.get(i["InstanceType"], 0.0) * HOURS_PER_MONTH if state in ("running", "pending") else 0.0
            found.append(Leftover("instance", i["InstanceId"], f"{i['InstanceType']} {state}", monthly))
    for volume in ec2.describe_volumes(Filters=_tag_filter(cluster))["Volumes"]:
        found.append(Leftover("volume", volume["VolumeId"], f"{volume['Size']} GB {volume['State']}",
                              volume["Size"] * TABLE["gp3_usd_per_gb_month"]))
    for fs in efs.describe_file_systems()["FileSystems"]:
        if {t["Key"]: t["Value"] for t in fs.get("Tags", [])}.get(CLUSTER_TAG) == cluster:
            gb = fs["SizeInBytes"]["Value"] / 1e9
            found.append(Leftover("file-system", fs["FileSystemId"], f"EFS {gb:.1f} GB",
                                  gb * TABLE["efs_standard_usd_per_gb_month"]))
    for eni in ec2.describe_network_interfaces(Filters=_tag_filter(cluster))["NetworkInterfaces"]:
        found.append(Leftover("network-interface", eni["NetworkInterfaceId"], eni["Status"], 0.0))
    for address in ec2.describe_addresses(Filters=_tag_filter(cluster))["Addresses"]:
        found.append(Leftover("address", address["AllocationId"], address["PublicIp"],
                              PUBLIC_IPV4_USD_PER_HOUR * HOURS_PER_MONTH))
    for key in ec2.describe_key_pairs(Filters=_tag_filter(cluster))["KeyPairs"]:
        found.append(Leftover("key-pair", key["KeyName"], key.get("KeyPairId", ""), 0.0))
    pages = ssm.get_paginator("describe_parameters").paginate(ParameterFilters=[
        {"Key": "Name", "Option": "BeginsWith", "Values": [f"/gpu-cluster/{cluster}/"]}])
    for page in pages:
        for parameter in page["Parameters"]:
            found.append(Leftover("parameter", parameter["Name"], parameter["Type"], 0.0))
    for page in logs.get_paginator("describe_log_groups").paginate():
        for group in page["logGroups"]:
            tags = logs.list_tags_for_resource(resourceArn=group["arn"].removesuffix(":*")).get("tags", {})
            if tags.get(CLUSTER_TAG) == cluster:
                stored = group.get("storedBytes", 0) / 1e9
                found.append(Leftover("log-group", group["logGroupName"], f"{stored:.2f} GB", stored * 0.03))
    for page in cloudwatch.get_paginator("describe_alarms").paginate():
        for alarm in page["MetricAlarms"]:
            tags = cloudwatch.list_tags_for_resource(ResourceARN=alarm["AlarmArn"])["Tags"]
            if {t["Key"]: t["Value"] for t in tags}.get(CLUSTER_TAG) == cluster:
                found.append(Leftover("alarm", alarm["AlarmName"], alarm["StateValue"], ALARM_USD_PER_MONTH))
    return found


def _delete_file_system(efs, fs_id: str) -> None:
    for target in efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]:
        efs.delete_mount_target(MountTargetId=target["MountTargetId"])
    efs.delete_file_system(FileSystemId=fs_id)


def delete(clients: dict, leftovers: list[Leftover], log: Callable[[str], None] = print) -> list[Leftover]:
    """Delete in dependency order (instances first). Returns what could not be deleted."""
    ec2, efs, ssm, logs, cloudwatch = (clients[k] for k in ("ec2", "efs", "ssm", "logs", "cloudwatch"))
    actions = {
        "instance": lambda i: ec2.terminate_instances(InstanceIds=[i]),
        "alarm": lambda i: cloudwatch.delete_alarms(AlarmNames=[i]),
        "file-system": lambda i: _delete_file_system(efs, i),
        "volume": lambda i: ec2.delete_volume(VolumeId=i),
        "network-interface": lambda i: ec2.delete_network_interface(NetworkInterfaceId=i),
        "address": lambda i: ec2.release_address(AllocationId=i),
        "key-pair": lambda i: ec2.delete_key_pair(KeyName=i),
        "parameter": lambda i: ssm.delete_parameter(Name=i),
        "log-group": lambda i: logs.delete_log_group(logGroupName=i),
    }
    order = list(actions)
    failed = []
    for leftover in sorted(leftovers, key=lambda item: order.index(item.kind)):
        try:
            actions[leftover.kind](leftover.id)
            log(f"deleted {leftover.kind} {leftover.id}")
        except Exception as error:  # noqa: BLE001 - report and go on with the rest
            log(f"could not delete {leftover.kind} {leftover.id}: {error}")
            failed.append(leftover)
    return failed
