"""The cluster's EC2 instances for `fab start` and `fab stop-cluster`: start them (after those still
stopping, never a Spot node EC2 interrupted, retrying a Spot request not yet disabled, undoing a half
start), refresh their addresses, stop them."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError, WaiterError

from cluster_node.protocol.contract import BUSY_METRIC, BUSY_UNIT, METRIC_NAMESPACE
from clusterops.inventory import Inventory, InventoryError, describe, refresh_addresses, write_known_hosts
from clusterops.terminal import aws_error


def _aws_ids(inventory: Inventory, what: str) -> list[str]:
    if inventory.source != "aws":
        raise InventoryError(f"fab {what} is for AWS clusters; the emulated one is `fab local.up` / `fab local.down`")
    return [n.instance_id for n in inventory.nodes if n.instance_id]


# EC2 stopped this Spot instance (an interruption): only EC2 starts it again, when capacity returns
# (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/interruption-behavior.html; the code:
# https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_StateReason.html).
SPOT_INTERRUPTED = "Server.SpotInstanceShutdown"


def spot_interrupted(described: dict) -> list[str]:
    """The stopped instances EC2 itself stopped for a Spot interruption (describe()'s answer)."""
    return sorted(
        i
        for i, d in described.items()
        if d["State"]["Name"] == "stopped" and d.get("StateReason", {}).get("Code") == SPOT_INTERRUPTED
    )


def busy_beat(cloudwatch, ids: list[str]) -> Optional[str]:
    """One busy heartbeat for each node, as its watchdog sends them. A node's idle alarm acts when it changes
    to ALARM, which a start does not undo: a node started as its alarm's window of missing beats runs out
    would be stopped by the alarm's EC2 action before the node's own first beat (which its boot sends too).
    Best effort: a policy without the grant starts the nodes anyway; returns the warning, else None."""
    metric = {"MetricName": BUSY_METRIC, "Value": 1.0, "Unit": BUSY_UNIT}
    try:
        cloudwatch.put_metric_data(
            Namespace=METRIC_NAMESPACE,
            MetricData=[{**metric, "Dimensions": [{"Name": "InstanceId", "Value": i}]} for i in ids],
        )
    except (ClientError, BotoCoreError) as error:
        why = aws_error(error) if isinstance(error, ClientError) else str(error)
        return (
            f"warning: no busy heartbeat before the start ({why}): a node whose idle alarm fires in the next "
            "minutes is stopped again (`fab start` once more); docs/user-policy.json's ABusyBeatBeforeAStart grants it"
        )
    return None


def start_and_refresh(
    inventory: Inventory,
    ec2,
    wait: bool = True,
    delay: float = 5,
    skip_interrupted: bool = False,
    cloudwatch=None,
    notes: Optional[list[str]] = None,
) -> Inventory:
    """Start the inventory's stopped instances (after those still stopping have stopped: EC2 refuses
    to start them), wait until all run, and return the inventory with their new addresses (a stop
    changes the public IP), the host key re-pinned. A capacity failure stops what did start. A Spot
    instance EC2 interrupted is not ours to start: refused, nothing started, unless skip_interrupted."""
    ids = _aws_ids(inventory, "start")
    described = describe(ec2, ids)
    states = {i: d["State"]["Name"] for i, d in described.items()}
    gone = [i for i in ids if states.get(i, "terminated") in ("terminated", "shutting-down")]
    if gone:
        raise InventoryError(
            f"{', '.join(gone)} no longer exist(s) (terminated): redeploy with `npx cdk deploy`, then `fab inventory`"
        )
    interrupted = spot_interrupted(described)
    if interrupted and (not skip_interrupted or inventory.head.instance_id in interrupted):
        raise InventoryError(
            f"{', '.join(interrupted)} stopped by a Spot interruption: only EC2 starts it again, when capacity "
            "returns; nothing started: `fab start` later"
            + (
                " (it is the head node, through which every task reaches the cluster)"
                if inventory.head.instance_id in interrupted
                else ", or `fab start --skip-interrupted` starts the others (then `fab train --exclude` it)"
            )
        )
    ids = [i for i in ids if i not in interrupted]
    stopping = [i for i in ids if states[i] == "stopping"]
    if stopping:
        ec2.get_waiter("instance_stopped").wait(InstanceIds=stopping, WaiterConfig={"Delay": delay, "MaxAttempts": 120})
    to_start = [i for i in ids if states[i] in ("stopped", "stopping")]
    if to_start:
        warning = busy_beat(cloudwatch, to_start) if cloudwatch is not None else None
        if warning and notes is not None:
            notes.append(warning)
        try:
            _start_instances(ec2, to_start, delay)
        except ClientError as error:
            if error.response["Error"]["Code"] != "InsufficientInstanceCapacity":
                raise
            raise InventoryError(_undo_partial_start(ec2, to_start, error.response["Error"]["Code"])) from None
    if wait and ids:
        try:
            ec2.get_waiter("instance_running").wait(InstanceIds=ids, WaiterConfig={"Delay": delay, "MaxAttempts": 120})
        except WaiterError:
            raise InventoryError(_undo_partial_start(ec2, to_start, _not_running_reason(ec2, ids))) from None
    nodes = refresh_addresses(inventory.nodes, ec2, via_ssm=bool(inventory.ssh.proxy_command))
    known_hosts = Path(inventory.ssh.known_hosts)
    host_key = known_hosts.read_text().split("\n", 1)[0].split(" ", 1)[1]
    write_known_hosts(known_hosts, [n.public_ip for n in nodes], host_key, port=inventory.ssh.port)
    return replace(inventory, nodes=nodes)


def _start_instances(ec2, ids: list[str], delay: float, tries: int = 24) -> None:
    """StartInstances. Right after a stop, a persistent Spot request stays `active`/`marked-for-stop` for a
    while and EC2 refuses the start with IncorrectSpotRequestState until it is `disabled`
    (hashicorp/terraform-provider-aws#33399): retried for ~2 min (24 x 5 s) before it is an error."""
    for attempt in range(tries):
        try:
            ec2.start_instances(InstanceIds=ids)
            return
        except ClientError as error:
            if error.response["Error"]["Code"] != "IncorrectSpotRequestState" or attempt == tries - 1:
                raise
            time.sleep(delay)


def _not_running_reason(ec2, ids: list[str]) -> str:
    reasons = {
        f"{i} {d['State']['Name']}: {d.get('StateReason', {}).get('Message', 'no reason given')}"
        for i, d in describe(ec2, ids).items()
        if d["State"]["Name"] != "running"
    }
    return "; ".join(sorted(reasons)) or "the instances did not reach running in time"


def _undo_partial_start(ec2, started: list[str], reason: str) -> str:
    """Stop the instances this start did bring up (a cluster placement group needs all nodes at once,
    and a half-started cluster bills for nothing); returns the one-line explanation."""
    up = sorted(i for i, d in describe(ec2, started).items() if d["State"]["Name"] in ("pending", "running"))
    if up:
        ec2.stop_instances(InstanceIds=up)
    return (
        f"the nodes could not all start ({reason}); stopped the {len(up)} that did, so nothing "
        "runs; AWS may lack capacity for the whole placement group now: try `fab start` later"
    )


def stop_nodes(inventory: Inventory, ec2) -> list[str]:
    """Stop the inventory's pending or running instances (`fab stop-cluster`); returns their ids."""
    ids = _aws_ids(inventory, "stop-cluster")
    up = sorted(i for i, d in describe(ec2, ids).items() if d["State"]["Name"] in ("pending", "running"))
    if up:
        ec2.stop_instances(InstanceIds=up)
    return up


def start_cluster(inventory: Inventory, ec2, skip_interrupted: bool = False, cloudwatch=None) -> tuple[Inventory, str]:
    """`fab start`: start_and_refresh, and the line saying what runs and which nodes stay down."""
    ids = [n.instance_id for n in inventory.nodes if n.instance_id]
    skipped = spot_interrupted(describe(ec2, ids)) if skip_interrupted and ids else []
    notes: list[str] = []
    fresh = start_and_refresh(inventory, ec2, skip_interrupted=skip_interrupted, cloudwatch=cloudwatch, notes=notes)
    down = [f"node{rank}" for rank, node in enumerate(fresh.nodes) if node.instance_id in skipped]
    waiting = f"{', '.join(down)} stay(s) down until EC2 starts them (a Spot interruption): `fab train --exclude "
    return fresh, "".join(f"{note}\n" for note in notes) + (
        (f"{waiting}{','.join(down)}`; the other " if down else "")
        + f"{len(fresh.nodes) - len(down)} node(s) running; head {fresh.head.public_ip}; run `fab status` once "
        "they are ready (data staged on instance-store NVMe was erased by the stop: stage it again with `fab data`)"
    )


class SpotNodesRunning(InventoryError):
    """release_spot's refusal: nodes of the cluster's Spot requests still run (`ids`; the requests: `requests`)."""

    def __init__(self, ids: list[str], requests: list[str]):
        self.ids, self.requests = ids, requests
        super().__init__(
            f"{', '.join(ids)} still run(s): stop them first with `fab stop-cluster` (EC2 cannot stop a Spot node "
            "once its request is cancelled); nothing cancelled"
        )


def release_spot(ec2, cluster: str, stopped: tuple[str, ...] = ()) -> str:
    """`fab release-spot`: cancel the cluster's persistent Spot requests before `cdk destroy`. Refused while a
    node of them runs: EC2 stops only Spot instances of a persistent request, so once it is cancelled nothing
    (`fab stop-cluster`, --then-stop, the idle watchdog) could stop that node; it would bill until destroyed.
    `stopped`: nodes whose StopInstances EC2 has just accepted (`fab destroy`), which DescribeInstances may
    still show running (the EC2 API is eventually consistent). Returns the line saying what it did."""
    from clusterops.aws.audit import spot_requests

    found = spot_requests(ec2, cluster, set())
    requests = [x.id for x in found if x.kind == "spot-request"]
    nodes = [x.id for x in found if x.kind == "instance"]
    running = {i for i, d in describe(ec2, nodes).items() if d["State"]["Name"] in ("pending", "running")}
    if up := sorted(running - set(stopped)):
        raise SpotNodesRunning(up, sorted(requests))
    if not requests:
        return f"no open Spot request tagged gpu-cluster:name={cluster}"
    ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=requests)
    held = f" (their nodes {', '.join(sorted(nodes))} stay stopped)" if nodes else ""
    return f"cancelled {', '.join(requests)}{held}: `npx cdk destroy` may go ahead"
