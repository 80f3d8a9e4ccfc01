"""`fab destroy`: `cdk destroy` of the inventory's stack, once deleting /data would lose nothing. The stack's
EFS goes with it (unless it was deployed with retain_data=true), and with it every run on /data: a run still
going, or one never fetched or changed since its last `fab fetch` (the node program
`cluster_node.programs.runs at-risk`, read on a node: each mounts /data), is refused in one line unless
--yes, as `fab local.down` refuses for the emulated cluster. So is a cluster no node of which answers (a
stopped one): what /data holds is then unknown; unless the file system is kept and EC2 says every node is
stopped (no run can be going: nothing to read, and no node to start and pay for). A stack already gone says
so; one in DELETE_FAILED (its file system may be gone) is destroyed again without the read. A Spot cluster's
persistent requests are cancelled first (its nodes stopped), as docs/operations.md advises besides the stack's
own release."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Optional, Protocol

from botocore.exceptions import ClientError, WaiterError

from cluster_node.protocol.contract import RETAIN_TAG
from clusterops.aws.instances import SpotNodesRunning, release_spot, stop_nodes
from clusterops.inventory import Inventory, describe
from stacks.config import stack_name as default_stack_name

YES = "`fab destroy --yes` destroys anyway"


class DestroyError(RuntimeError):
    """Refused, or `cdk destroy` failed; the message is one line."""


class UnansweredError(RuntimeError):
    """A node ran the at-risk program and it failed (an older image's cluster_node): not a connection error."""


class AtRisk(Protocol):
    """What deleting /data would lose (clusterops.nodes.records.AtRisk: the node program's answer)."""

    active: Optional[str]
    unfetched: tuple[str, ...]


def destroy(
    inventory: Inventory, clients: dict, read: Callable[[], AtRisk], project: Path, yes: bool, say=print
) -> str:
    """`cdk destroy` of the inventory's stack from the app in `project` (clients: cloudformation, efs, ec2),
    unless it would lose work (`yes` skips the check); returns the line that says what happened, or raises
    DestroyError saying why not or that it failed."""
    stack = stack_of(inventory)
    status = stack_status(clients["cloudformation"], stack)
    if status is None:
        return f"no stack {stack} in {inventory.region}: nothing to destroy (`fab audit` lists anything left)"
    if status != "DELETE_FAILED" and not yes:
        kept = retained(clients["efs"], inventory.file_system_id)
        why = None if kept and all_stopped(inventory, clients["ec2"]) else refusal(inventory, read, kept)
        if why:
            raise DestroyError(why)
    argv = command(inventory, project)  # before the Spot step: a missing CLI must leave the requests open
    if inventory.spot:
        stopped = stop_nodes(inventory, clients["ec2"])
        say(f"stopped {', '.join(stopped) or 'no node (none running)'}")
        try:
            say(release_spot(clients["ec2"], inventory.cluster, tuple(stopped)))
        except SpotNodesRunning as running:  # not the inventory's (those were just stopped): a request's new node
            raise DestroyError(spot_nodes_outside(running.ids, running.requests, inventory.region)) from None
    say("$ " + " ".join(argv))
    env = {**os.environ, **({"AWS_REGION": inventory.region} if inventory.region else {})}
    failed = subprocess.run(argv, env=env, cwd=project).returncode != 0
    left = stack_status(clients["cloudformation"], stack)
    if failed or left is not None:
        raise DestroyError(
            f"`cdk destroy` did not delete {stack} ({left or 'failed'}): `fab destroy` again, "
            "and `fab audit` lists what is left (`--delete` removes it)"
        )
    return f"destroyed {stack}: `fab audit` lists anything left of {inventory.cluster}, with its monthly cost"


def spot_nodes_outside(ids: list[str], requests: list[str], region: Optional[str]) -> str:
    """A running node of the cluster's persistent requests that `fab destroy` did not stop: not the inventory's (a
    request launches a new node when its node is terminated), so `cdk destroy` would leave it billing. Cancelled
    first, then terminated: terminated first, its request would launch another. The inventory's nodes are stopped
    by then, so no node would answer the retry's /data check (done already): the retry takes --yes."""
    where = f" --region {region}" if region else ""
    return (
        f"{', '.join(ids)} of the cluster's Spot requests still run(s), not in the inventory: cancel the requests, "
        f"then terminate the node(s) (`aws ec2 cancel-spot-instance-requests{where} --spot-instance-request-ids "
        f"{' '.join(requests)}`, then `aws ec2 terminate-instances{where} --instance-ids {' '.join(ids)}`), then "
        "`fab destroy --yes` (/data was checked before the inventory's nodes were stopped); nothing cancelled "
        "or destroyed"
    )


def stack_of(inventory: Inventory) -> str:
    return inventory.stack_name or default_stack_name(None, inventory.cluster)


def stack_status(cfn, stack: str) -> Optional[str]:
    """The stack's status; None when there is none (deleted)."""
    try:
        found = cfn.describe_stacks(StackName=stack)["Stacks"]
    except ClientError as error:
        if "does not exist" in str(error):
            return None
        raise
    status = found[0]["StackStatus"] if found else None
    return None if status in (None, "DELETE_COMPLETE") else status


def retained(efs, file_system_id: Optional[str]) -> bool:
    """The stack keeps its file system (deployed with retain_data=true: tagged RETAIN_TAG); a file system
    already gone keeps nothing."""
    if not file_system_id:
        return False
    try:
        found = efs.describe_file_systems(FileSystemId=file_system_id)["FileSystems"]
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") == "FileSystemNotFound":
            return False
        raise
    return any(t["Key"] == RETAIN_TAG and t["Value"] == "true" for fs in found for t in fs.get("Tags", []))


def all_stopped(inventory: Inventory, ec2, delay: float = 15) -> bool:
    """EC2 says every node of the inventory is stopped: no run can be going, so a stack that keeps its file
    system (retain_data=true) loses nothing, and no node need be started (and billed) to read /data. Nodes still
    `stopping` (`fab stop-cluster` just before: minutes for a GPU node) are waited for; a wait that fails is a no."""
    ids = [n.instance_id for n in inventory.nodes if n.instance_id]
    if not ids or len(ids) != len(inventory.nodes):
        return False
    states = {i: d["State"]["Name"] for i, d in describe(ec2, ids).items()}
    if len(states) != len(ids) or not set(states.values()) <= {"stopped", "stopping"}:
        return False
    if stopping := [i for i, state in states.items() if state == "stopping"]:
        try:
            ec2.get_waiter("instance_stopped").wait(
                InstanceIds=stopping, WaiterConfig={"Delay": delay, "MaxAttempts": 40}
            )
        except WaiterError:
            return False
    return True


def refusal(inventory: Inventory, read: Callable[[], AtRisk], kept: bool) -> Optional[str]:
    """Why destroying now would lose work, in one line; None when nothing would be lost."""
    try:
        risk = read()
    except UnansweredError as error:  # a node answered, its program did not: an older image's cluster_node
        first = (str(error).splitlines() or ["?"])[-1][-200:]
        return f"the nodes could not say what /data holds ({first}): `fab sync`, then `fab destroy` again; or {YES}"
    except Exception as error:  # noqa: BLE001 - unreachable, refused, timed out: /data is unknown
        first = (str(error).splitlines() or [type(error).__name__])[0]
        return (
            f"no node answered ({first}): what /data holds is unknown; a stopped cluster needs `fab start`, "
            f"then `fab fetch --run NAME` for the runs you keep; or {YES}"
        )
    if risk.active:
        name = risk.active
        return f"run {name} is going: `fab stop --run {name}`, then `fab fetch --run {name}`; or {YES}"
    if risk.unfetched and not kept:
        return (
            f"/data holds runs never fetched or changed since: {', '.join(risk.unfetched)}; the file system goes "
            f"with the stack: `fab fetch --run NAME` each, or {YES}"
        )
    return None


def command(inventory: Inventory, project: Path) -> list[str]:
    """The project's pinned CDK CLI (`npm ci` puts it in node_modules/.bin; npx would fetch the newest,
    which may not read this app's assembly) destroying this stack, named by the context that names it
    and nothing else (the app runs for destroy too and must find the same stack)."""
    cli = project / "node_modules" / ".bin" / "cdk"
    if not cli.exists():
        raise DestroyError(f"no pinned CDK CLI in {cli.parent}: `bash scripts/setup.sh` (its `npm ci`) first")
    stack = stack_of(inventory)
    return [str(cli), "destroy", stack, "--force", "-c", f"cluster_name={inventory.cluster}"] + [
        "-c",
        f"stack_name={stack}",
    ]
