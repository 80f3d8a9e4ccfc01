"""`fab audit --delete`: delete what the audit found in dependency order, each step waiting for
the previous one. Functions take boto3 clients."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from botocore.exceptions import BotoCoreError, ClientError, WaiterError

from clusterops.aws.leftover import KEPT, Leftover

# A volume in these states is on its way out (a root volume with DeleteOnTermination): gone for us.
VOLUME_GONE = ("deleting", "deleted")
KMS_PENDING_DAYS = 7  # the shortest waiting period KMS allows; the key stops billing at once


@dataclass(frozen=True)
class Pace:
    """How deletion waits: waiter delay and attempts, and the polls between steps."""

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
    """After the instances are terminated: a volume still attached is VolumeInUse. Root volumes with
    DeleteOnTermination are `deleting` or gone by then (gone for us); the rest are deleted once
    `available` (the volume_available waiter would wait out its attempts on a `deleting` one)."""
    ec2, todo = clients["ec2"], set(ids)
    for _ in range(pace.attempts):
        volumes = ec2.describe_volumes(Filters=[{"Name": "volume-id", "Values": sorted(todo)}])["Volumes"]
        states = {v["VolumeId"]: v["State"] for v in volumes}
        for volume_id in sorted(todo):
            state = states.get(volume_id, "deleted")
            if state == "available":
                ec2.delete_volume(VolumeId=volume_id)
            if state == "available" or state in VOLUME_GONE:
                todo.discard(volume_id)
        if not todo:
            return
        pace.sleep(pace.delay)
    raise TimeoutError(f"volumes {', '.join(sorted(todo))} are still attached")


def _delete_nat_gateways(clients, ids, pace, log) -> None:
    """Their Elastic IPs can be released only once the gateways are deleted."""
    ec2 = clients["ec2"]
    for nat in ids:
        ec2.delete_nat_gateway(NatGatewayId=nat)
    ec2.get_waiter("nat_gateway_deleted").wait(NatGatewayIds=ids, WaiterConfig=pace.waiter())


def _delete_stacks(clients, ids, pace, log) -> None:
    """A stack in DELETE_FAILED, once the resources it left are deleted: its delete asked again (a resource
    already gone counts as deleted), waited for."""
    cloudformation = clients["cloudformation"]
    for name in ids:
        cloudformation.delete_stack(StackName=name)
    for name in ids:
        cloudformation.get_waiter("stack_delete_complete").wait(StackName=name, WaiterConfig=pace.waiter())


def _each(call: Callable[[dict, str], object]):
    def step(clients, ids, pace, log) -> None:
        for one in ids:
            call(clients, one)

    return step


# Alarms first (they would act on the instances), Spot requests before their instances (else they
# launch new ones), instances before what they hold, NAT gateways before their addresses, the KMS
# key last but for a stack whose delete failed (the flow-log group is encrypted with the key; the stack is
# deleted again once what it left is gone).
STEPS = {
    "alarm": _each(lambda c, i: c["cloudwatch"].delete_alarms(AlarmNames=[i])),
    "spot-request": lambda c, ids, pace, log: c["ec2"].cancel_spot_instance_requests(SpotInstanceRequestIds=ids),
    "instance": _delete_instances,
    "file-system": _delete_file_systems,
    "network-interface": _delete_network_interfaces,
    "volume": _delete_volumes,
    "vpc-endpoint": lambda c, ids, pace, log: c["ec2"].delete_vpc_endpoints(VpcEndpointIds=ids),
    "nat-gateway": _delete_nat_gateways,
    "address": _each(lambda c, i: c["ec2"].release_address(AllocationId=i)),
    "key-pair": _each(lambda c, i: c["ec2"].delete_key_pair(KeyName=i)),
    "parameter": _each(lambda c, i: c["ssm"].delete_parameter(Name=i)),
    "log-group": _each(lambda c, i: c["logs"].delete_log_group(logGroupName=i)),
    "dashboard": lambda c, ids, pace, log: c["cloudwatch"].delete_dashboards(DashboardNames=ids),
    "kms-key": _each(lambda c, i: c["kms"].schedule_key_deletion(KeyId=i, PendingWindowInDays=KMS_PENDING_DAYS)),
    "stack": _delete_stacks,
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
                    log(
                        f"deleted {x.kind} {x.id}"
                        + (f" (pending for {KMS_PENDING_DAYS} days)" if kind == "kms-key" else "")
                    )
        except (ClientError, BotoCoreError, WaiterError, TimeoutError) as error:
            log(f"could not delete {kind} {', '.join(x.id for x in todo)}: {error}")
            failed += todo
    return failed
