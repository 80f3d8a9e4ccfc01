"""What is left of a cluster after `cdk destroy` (or before): everything tagged gpu-cluster:name=NAME,
the untagged network interfaces of its instances and security groups, the public IPv4 addresses of
its running instances, its SSM parameters, and the CDK bootstrap bucket's objects; each with a monthly
cost ("unknown" when no price is known). Deletion goes in dependency order, waiting for each step.
A file system kept with retain_data=true (tag gpu-cluster:retain=true) is deleted only when asked.
Functions take boto3 clients."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from botocore.exceptions import BotoCoreError, ClientError, WaiterError

from assets.contract import CLUSTER_TAG, RETAIN_TAG, parameter_prefix

from .cost import HOURS_PER_MONTH, TABLE, offline_price

CDK_QUALIFIER = "hnb659fds"  # the default `cdk bootstrap` qualifier
# Reported, never deleted here: they go with something else, or are not only this cluster's.
KEPT = {
    "public-ipv4": "released when its instance stops or terminates",
    "cdk-assets": "shared by every CDK app of this account and region: `npx cdk gc --unstable=gc` "
    "deletes the unused ones",
}


@dataclass(frozen=True)
class Leftover:
    kind: str
    id: str
    detail: str
    usd_per_month: Optional[float]  # None: unknown
    retained: bool = False


def _tag_filter(cluster: str) -> list[dict]:
    return [{"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]}]


def _tags(items: list[dict]) -> dict:
    return {t["Key"]: t["Value"] for t in items or []}


def _instances(ec2, filters: list[dict]) -> list[Leftover]:
    found = []
    pages = ec2.get_paginator("describe_instances").paginate(Filters=filters)
    for i in (i for page in pages for r in page["Reservations"] for i in r["Instances"]):
        state = i["State"]["Name"]
        if state in ("terminated", "shutting-down"):
            continue
        price = offline_price(i["InstanceType"], ec2.meta.region_name).usd_per_hour
        running = state in ("running", "pending")
        monthly = (None if price is None else price * HOURS_PER_MONTH) if running else 0.0
        found.append(Leftover("instance", i["InstanceId"], f"{i['InstanceType']} {state}", monthly))
        if running and i.get("PublicIpAddress"):
            found.append(
                Leftover(
                    "public-ipv4",
                    i["PublicIpAddress"],
                    f"on {i['InstanceId']}",
                    TABLE["public_ipv4_usd_per_hour"] * HOURS_PER_MONTH,
                )
            )
    return found


def spot_requests(ec2, cluster: str, known: set[str]) -> list[Leftover]:
    """Spot nodes' persistent requests (tagged by their launch templates), and an instance one of
    them launched that is not tagged: terminating a node of a persistent request reopens it and
    EC2 launches another, so `cdk destroy` alone can leave nodes running. Cancel them first."""
    found = []
    pages = ec2.get_paginator("describe_spot_instance_requests").paginate(
        Filters=_tag_filter(cluster) + [{"Name": "state", "Values": ["open", "active", "disabled"]}]
    )
    for request in (r for page in pages for r in page["SpotInstanceRequests"]):
        instance = request.get("InstanceId")
        found.append(
            Leftover(
                "spot-request",
                request["SpotInstanceRequestId"],
                f"{request['Type']} {request['State']}, instance {instance or 'none yet'}: "
                "launches a node whenever its instance is gone",
                0.0,
            )
        )
        if instance and instance not in known:
            found += _instances(ec2, [{"Name": "instance-id", "Values": [instance]}])
    return found


def _network_interfaces(ec2, cluster: str, instance_ids: list[str]) -> list[Leftover]:
    """ENIs carry no tags: found by the instances they are attached to and by the cluster's
    security groups (the EFS mount targets' too), and by tag for any created by hand."""
    groups = [g["GroupId"] for g in ec2.describe_security_groups(Filters=_tag_filter(cluster))["SecurityGroups"]]
    filters = [_tag_filter(cluster)]
    if instance_ids:
        filters.append([{"Name": "attachment.instance-id", "Values": instance_ids}])
    if groups:
        filters.append([{"Name": "group-id", "Values": groups}])
    enis = {
        e["NetworkInterfaceId"]: e
        for f in filters
        for e in ec2.describe_network_interfaces(Filters=f)["NetworkInterfaces"]
    }
    return [
        Leftover("network-interface", eni_id, f"{e['Status']} {e.get('Description', '')}".strip(), 0.0)
        for eni_id, e in sorted(enis.items())
    ]


def _file_systems(efs, cluster: str) -> list[Leftover]:
    found = []
    for fs in efs.describe_file_systems()["FileSystems"]:
        tags = _tags(fs.get("Tags"))
        if tags.get(CLUSTER_TAG) == cluster:
            gb = fs["SizeInBytes"]["Value"] / 1e9
            retained = tags.get(RETAIN_TAG) == "true"
            found.append(
                Leftover(
                    "file-system",
                    fs["FileSystemId"],
                    f"EFS {gb:.1f} GB" + (" (kept: retain_data=true)" if retained else ""),
                    gb * TABLE["efs_standard_usd_per_gb_month"],
                    retained,
                )
            )
    return found


def _tagged_elsewhere(ssm, logs, cloudwatch, cluster: str) -> list[Leftover]:
    found = []
    pages = ssm.get_paginator("describe_parameters").paginate(
        ParameterFilters=[{"Key": "Name", "Option": "BeginsWith", "Values": [parameter_prefix(cluster)]}]
    )
    found += [Leftover("parameter", p["Name"], p["Type"], 0.0) for page in pages for p in page["Parameters"]]
    for page in logs.get_paginator("describe_log_groups").paginate():
        for group in page["logGroups"]:
            tags = logs.list_tags_for_resource(resourceArn=group["arn"].removesuffix(":*")).get("tags", {})
            if tags.get(CLUSTER_TAG) == cluster:
                stored = group.get("storedBytes", 0) / 1e9
                found.append(Leftover("log-group", group["logGroupName"], f"{stored:.2f} GB", stored * 0.03))
    for page in cloudwatch.get_paginator("describe_alarms").paginate():
        for alarm in page["MetricAlarms"]:
            tags = _tags(cloudwatch.list_tags_for_resource(ResourceARN=alarm["AlarmArn"])["Tags"])
            if tags.get(CLUSTER_TAG) == cluster:
                found.append(Leftover("alarm", alarm["AlarmName"], alarm["StateValue"], TABLE["alarm_usd_per_month"]))
    return found


def cdk_assets(sts, s3, region: str) -> list[Leftover]:
    """The CDK bootstrap bucket: every deploy uploads assets (this app's image context zip) that
    `cdk destroy` leaves behind. Which objects are this app's cannot be told from outside."""
    bucket = f"cdk-{CDK_QUALIFIER}-assets-{sts.get_caller_identity()['Account']}-{region}"
    try:
        objects = [
            o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket) for o in page.get("Contents", [])
        ]
    except ClientError:  # no bootstrap in this region, or no access
        return []
    gb = sum(o["Size"] for o in objects) / 1e9
    return [
        Leftover(
            "cdk-assets", bucket, f"{len(objects)} objects, {gb:.2f} GB", gb * TABLE["s3_standard_usd_per_gb_month"]
        )
    ]


def find(clients: dict, cluster: str) -> list[Leftover]:
    ec2 = clients["ec2"]
    found = _instances(ec2, _tag_filter(cluster))
    found += spot_requests(ec2, cluster, {x.id for x in found if x.kind == "instance"})
    found += [
        Leftover("volume", v["VolumeId"], f"{v['Size']} GB {v['State']}", v["Size"] * TABLE["gp3_usd_per_gb_month"])
        for v in ec2.describe_volumes(Filters=_tag_filter(cluster))["Volumes"]
    ]
    found += _file_systems(clients["efs"], cluster)
    found += _network_interfaces(ec2, cluster, [x.id for x in found if x.kind == "instance"])
    found += [
        Leftover("address", a["AllocationId"], a["PublicIp"], TABLE["public_ipv4_usd_per_hour"] * HOURS_PER_MONTH)
        for a in ec2.describe_addresses(Filters=_tag_filter(cluster))["Addresses"]
    ]
    found += [
        Leftover("key-pair", k["KeyName"], k.get("KeyPairId", ""), 0.0)
        for k in ec2.describe_key_pairs(Filters=_tag_filter(cluster))["KeyPairs"]
    ]
    found += _tagged_elsewhere(clients["ssm"], clients["logs"], clients["cloudwatch"], cluster)
    if "sts" in clients and "s3" in clients:
        found += cdk_assets(clients["sts"], clients["s3"], ec2.meta.region_name)
    return found


def monthly_total(leftovers: list[Leftover]) -> str:
    known = sum(x.usd_per_month for x in leftovers if x.usd_per_month is not None)
    unknown = [x for x in leftovers if x.usd_per_month is None]
    return f"${known:.2f}/month" + (f" + unknown for {len(unknown)} resource(s) without a price" if unknown else "")


# ---------------------------------------------------------------- deletion, in dependency order


@dataclass(frozen=True)
class Pace:
    """How deletion waits: waiter delay and attempts, and the mount-target poll."""

    delay: float = 5.0
    attempts: int = 120
    sleep: Callable[[float], None] = time.sleep

    def waiter(self) -> dict:
        return {"Delay": self.delay, "MaxAttempts": self.attempts}


def _delete_instances(clients, ids, pace, log) -> None:
    clients["ec2"].terminate_instances(InstanceIds=ids)
    clients["ec2"].get_waiter("instance_terminated").wait(InstanceIds=ids, WaiterConfig=pace.waiter())


def _delete_file_systems(clients, ids, pace, log) -> None:
    """Mount targets first; their deletion is asynchronous: the file system goes only once
    describe_mount_targets lists none (else FileSystemInUse)."""
    efs = clients["efs"]
    for fs_id in ids:
        for target in efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]:
            efs.delete_mount_target(MountTargetId=target["MountTargetId"])
        for _ in range(pace.attempts):
            if not efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]:
                break
            pace.sleep(pace.delay)
        else:
            raise TimeoutError(f"the mount targets of {fs_id} are still being deleted")
        efs.delete_file_system(FileSystemId=fs_id)


def _delete_network_interfaces(clients, ids, pace, log) -> set[str]:
    """Attached ENIs go with their instance or mount target; only detached ones are deleted.
    Returns the ones left attached."""
    ec2, left = clients["ec2"], set()
    enis = ec2.describe_network_interfaces(Filters=[{"Name": "network-interface-id", "Values": ids}])
    for eni in enis["NetworkInterfaces"]:
        if eni["Status"] == "available":
            ec2.delete_network_interface(NetworkInterfaceId=eni["NetworkInterfaceId"])
        else:
            log(f"left network-interface {eni['NetworkInterfaceId']}: {eni['Status']} (goes with its attachment)")
            left.add(eni["NetworkInterfaceId"])
    return left


def _delete_volumes(clients, ids, pace, log) -> None:
    """After the instances are terminated: a volume still attached is VolumeInUse. Root volumes
    with DeleteOnTermination are gone by then."""
    ec2 = clients["ec2"]
    left = [v["VolumeId"] for v in ec2.describe_volumes(Filters=[{"Name": "volume-id", "Values": ids}])["Volumes"]]
    if left:
        ec2.get_waiter("volume_available").wait(VolumeIds=left, WaiterConfig=pace.waiter())
        for volume_id in left:
            ec2.delete_volume(VolumeId=volume_id)


def _each(call: Callable[[dict, str], object]):
    def step(clients, ids, pace, log) -> None:
        for one in ids:
            call(clients, one)

    return step


# Alarms first (they would act on the instances), Spot requests before their instances (else they
# launch new ones), instances before what they hold.
STEPS = {
    "alarm": _each(lambda c, i: c["cloudwatch"].delete_alarms(AlarmNames=[i])),
    "spot-request": lambda c, ids, pace, log: c["ec2"].cancel_spot_instance_requests(SpotInstanceRequestIds=ids),
    "instance": _delete_instances,
    "file-system": _delete_file_systems,
    "network-interface": _delete_network_interfaces,
    "volume": _delete_volumes,
    "address": _each(lambda c, i: c["ec2"].release_address(AllocationId=i)),
    "key-pair": _each(lambda c, i: c["ec2"].delete_key_pair(KeyName=i)),
    "parameter": _each(lambda c, i: c["ssm"].delete_parameter(Name=i)),
    "log-group": _each(lambda c, i: c["logs"].delete_log_group(logGroupName=i)),
}


def delete(
    clients: dict,
    leftovers: list[Leftover],
    log: Callable[[str], None] = print,
    include_retained: bool = False,
    pace: Pace = Pace(),
) -> list[Leftover]:
    """Delete in dependency order, each step waiting for the previous one to finish. Returns what
    could not be deleted; retained data and shared things are kept (and said so)."""
    for x in leftovers:
        if x.kind in KEPT:
            log(f"kept {x.kind} {x.id}: {KEPT[x.kind]}")
        elif x.retained and not include_retained:
            log(f"kept {x.kind} {x.id}: retain_data=true; `fab audit --delete --include-retained` deletes it")
    failed = []
    for kind, step in STEPS.items():
        todo = [x for x in leftovers if x.kind == kind and (include_retained or not x.retained)]
        if not todo:
            continue
        try:
            left = step(clients, [x.id for x in todo], pace, log) or set()
            for x in todo:
                if x.id not in left:
                    log(f"deleted {x.kind} {x.id}")
        except (ClientError, BotoCoreError, WaiterError, TimeoutError) as error:
            log(f"could not delete {kind} {', '.join(x.id for x in todo)}: {error}")
            failed += todo
    return failed
