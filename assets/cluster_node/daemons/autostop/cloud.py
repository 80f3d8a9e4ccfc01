"""The watchdog's AWS side: the cluster's instances and their stop, the heartbeat, and idle_minutes
as the stack sets it now (its SSM parameter, read again every few minutes)."""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from cluster_node.protocol.contract import BUSY_METRIC, BUSY_UNIT, CLUSTER_TAG, METRIC_NAMESPACE

IDLE_REFRESH_S = 5 * 60.0  # how often idle_minutes is read again from its parameter


# The nodes' creation policy waits 45 min for a bootstrap's signal (stacks/nodes.py BOOTSTRAP_TIMEOUT).
BOOTSTRAP_HOLD_S = 50 * 60


def _instances(ec2, cluster: str, states: Sequence[str]) -> list[dict]:
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": list(states)},
        ]
    )
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def cluster_instances(ec2, cluster: str, states: Sequence[str] = ("pending", "running")) -> list[str]:
    return sorted(i["InstanceId"] for i in _instances(ec2, cluster, states))


def bootstrapping(ec2, cluster: str, ready: set[str], now: float) -> list[str]:
    """The cluster's nodes a deploy is still bootstrapping: launched within BOOTSTRAP_HOLD_S, and no ready
    mark names them. Stopped now, each would fail its deploy 45 min later (its bootstrap killed)."""
    return sorted(
        i["InstanceId"]
        for i in _instances(ec2, cluster, ("pending", "running"))
        if i["InstanceId"] not in ready and now - i["LaunchTime"].timestamp() < BOOTSTRAP_HOLD_S
    )


STOP_TRIES = 4  # per node, STOP_DELAY_S apart, doubling: a node still `pending` refuses (IncorrectInstanceState)
STOP_DELAY_S = 2.0


def stop_each(ec2, ids: Sequence[str], tries: int = STOP_TRIES, own: Optional[str] = None) -> dict[str, str]:
    """StopInstances once per node (one call for all fails all when one node refuses, e.g. a `pending` one),
    a refused node asked again up to `tries` times with backoff. Node -> "stopping", or its last error. `own`, the
    caller's node, goes last: its stop shuts its OS down, and the container with this process goes with it."""
    outcome = _stop_each(ec2, [i for i in ids if i != own], tries)
    return {**outcome, **(_stop_each(ec2, [own], tries) if own is not None and own in ids else {})}


def stop_others_first(ec2, ids: Sequence[str], own: Optional[str]) -> dict[str, str]:
    """One try per node, `own` only once every other node is stopping: a watchdog that stopped its own node with
    another refused would go down with it, and the refused node would bill on; kept up, it retries next round."""
    outcome = _stop_each(ec2, [i for i in ids if i != own], 1)
    if own is None or own not in ids:
        return outcome
    # Only for a refusal the next round may not meet (a `pending` node): a lasting one (a Spot node after
    # `fab release-spot`) would keep this node up, billed, for nothing.
    if any(state != "stopping" and "IncorrectInstanceState" in state for state in outcome.values()):
        return {**outcome, own: "not yet: stopped last, once every other node is stopping"}
    return {**outcome, **_stop_each(ec2, [own], 1)}


def _stop_each(ec2, ids: Sequence[str], tries: int) -> dict[str, str]:
    outcome: dict[str, str] = {}
    left = list(ids)
    for attempt in range(tries):
        if attempt:
            time.sleep(STOP_DELAY_S * 2 ** (attempt - 1))
        for instance in list(left):
            try:
                ec2.stop_instances(InstanceIds=[instance])
            except Exception as error:  # noqa: BLE001 - any refusal is this node's, reported, retried
                outcome[instance] = (str(error).splitlines() or [""])[0] or type(error).__name__
                continue
            outcome[instance] = "stopping"
            left.remove(instance)
        if not left:
            break
    return outcome


def stop_cluster(ec2, cluster: str, own: Optional[str] = None) -> list[str]:
    """Stop every running instance tagged with the cluster's name, node by node, once (the idle loop retries
    on its own clock), `own` last; returns their ids. RuntimeError naming each node EC2 refused (the others are
    stopping)."""
    ids = cluster_instances(ec2, cluster)
    outcome = stop_others_first(ec2, ids, own)
    refused = [f"{i}: {outcome[i]}" for i in ids if outcome[i] != "stopping"]
    if refused:
        raise RuntimeError(f"{len(refused)} of {len(ids)} node(s) refused: " + "; ".join(refused))
    return ids


def publish(cloudwatch, instance_id: str, busy: bool, seen=None) -> None:
    """The heartbeat (the alarm's metric) and, on GPU nodes, GPU utilisation and memory for the dashboard."""
    dimensions = [{"Name": "InstanceId", "Value": instance_id}]
    data = [{"MetricName": BUSY_METRIC, "Dimensions": dimensions, "Value": 1.0 if busy else 0.0, "Unit": BUSY_UNIT}]
    gpu = (("GPUUtilization", seen.gpu_util), ("GPUMemoryUsedPercent", seen.gpu_memory)) if seen else ()
    for name, value in gpu:
        if value is not None:
            data.append({"MetricName": name, "Dimensions": dimensions, "Value": float(value), "Unit": "Percent"})
    cloudwatch.put_metric_data(Namespace=METRIC_NAMESPACE, MetricData=data)


def refusal_hint(error: Exception) -> str:
    if "UnsupportedOperation" in str(error):
        # EC2 User Guide, "Stop a Spot Instance": a Spot Instance whose request is cancelled (fab
        # release-spot) or one-time can only be terminated; the alarm's stop action fails alike.
        return "; EC2 stops no Spot node whose request was cancelled (fab release-spot): `npx cdk destroy` ends it"
    return ""


class IdleLimit:
    """idle_minutes now. The container's IDLE_MINUTES is the parameter's value when the container was
    created; `cdk deploy -c idle_minutes=N` changes the parameter (and creates or deletes the alarms)
    on a running cluster, so the watchdog reads it again every `refresh` seconds. A read that fails
    or a value that is not a number >= 0 keeps the last value, said once."""

    def __init__(self, ssm, name: str, value: float, refresh: float = IDLE_REFRESH_S, log: Callable = print):
        self.ssm, self.name, self.value, self.refresh, self.log = ssm, name, value, refresh, log
        self.read_at: Optional[float] = None
        self.said = ""

    def current(self, now: Optional[float] = None) -> float:
        now = time.time() if now is None else now
        if self.ssm is None or (self.read_at is not None and now - self.read_at < self.refresh):
            return self.value
        self.read_at = now
        try:
            text = self.ssm.get_parameter(Name=self.name)["Parameter"]["Value"]
            value = float(text)
            if not value >= 0:
                raise ValueError(f"{text!r} is not a number of minutes >= 0")
        except Exception as error:  # noqa: BLE001 - a failed read keeps the last value; the watch goes on
            if str(error) != self.said:
                self.said = str(error)
                self.log(f"idle_minutes not read from {self.name} ({error}); keeping {self.value:g}")
            return self.value
        self.said = ""
        if value != self.value:
            self.log(f"idle_minutes {self.value:g} -> {value:g} (from {self.name})")
            self.value = value
        return value
