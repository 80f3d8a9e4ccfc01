"""`fab destroy`: `npx cdk destroy` of the inventory's stack, once deleting /data would lose nothing. The
stack's EFS goes with it (unless it was deployed with retain_data=true), and with it every run on /data:
a run still going, or one never fetched or changed since its last `fab fetch`
(cluster_node.programs.runs at-risk, read on the head node), is refused in one line unless --yes, as
`fab local.down` refuses for the emulated cluster. A head node that cannot be reached (a stopped cluster)
is refused too: what /data holds is then unknown."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Optional

from cluster_node.protocol.contract import RETAIN_TAG
from clusterops.inventory import Inventory
from clusterops.nodes.records import AtRisk
from stacks.config import stack_name as default_stack_name

YES = "`fab destroy --yes` destroys anyway"


class DestroyError(RuntimeError):
    """Refused, or `cdk destroy` failed; the message is one line."""


def destroy(inventory: Inventory, efs, read: Callable[[], AtRisk], project: Path, yes: bool, say=print) -> None:
    """`cdk destroy` of the inventory's stack from the app in `project`, unless it would lose work (`yes`
    skips the check); DestroyError says why not, or that it failed."""
    kept = retained(efs, inventory.file_system_id)
    why = None if yes else refusal(inventory, read, kept)
    if why:
        raise DestroyError(why)
    argv = command(inventory, project)
    say("$ " + " ".join(argv))
    env = {**os.environ, **({"AWS_REGION": inventory.region} if inventory.region else {})}
    if subprocess.run(argv, env=env, cwd=project).returncode != 0:
        raise DestroyError("`cdk destroy` failed (above): `fab audit` lists what is left, `--delete` removes it")


def retained(efs, file_system_id: Optional[str]) -> bool:
    """The stack keeps its file system (deployed with retain_data=true: tagged RETAIN_TAG)."""
    if not file_system_id:
        return False
    found = efs.describe_file_systems(FileSystemId=file_system_id)["FileSystems"]
    return any(t["Key"] == RETAIN_TAG and t["Value"] == "true" for fs in found for t in fs.get("Tags", []))


def refusal(inventory: Inventory, read: Callable[[], AtRisk], kept: bool) -> Optional[str]:
    """Why destroying now would lose work, in one line; None when nothing would be lost."""
    try:
        risk = read()
    except Exception as error:  # noqa: BLE001 - unreachable, refused, timed out: /data is unknown
        first = (str(error).splitlines() or [type(error).__name__])[0]
        return (
            f"cannot read /data on {inventory.head.name} ({first}): a stopped cluster needs `fab start`, "
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
    """The CDK CLI's destroy of this stack: its name and the context that names it, nothing else (the app
    runs for destroy too and must find the same stack). The project's pinned CLI (`npm ci` put it in
    node_modules/.bin: what `npx cdk` runs there), else npx's."""
    stack = inventory.stack_name or default_stack_name(None, inventory.cluster)
    pinned = project / "node_modules" / ".bin" / "cdk"
    cli = [str(pinned)] if pinned.exists() else ["npx", "cdk"]
    argv = [*cli, "destroy", stack, "--force", "-c", f"cluster_name={inventory.cluster}"]
    if stack != default_stack_name(None, inventory.cluster):
        argv += ["-c", f"stack_name={stack}"]
    return argv
