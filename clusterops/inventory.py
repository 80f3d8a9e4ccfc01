"""Inventory: the nodes in rank order and how to reach them.

Written by `fab local.up` for the emulated cluster, or built from the outputs file `cdk deploy`
writes (fallback: describe the stack with boto3). The private key and the cluster host key are
fetched from SSM Parameter Store once; host keys are pinned, never blindly accepted.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from cluster_node.protocol import clusterdir
from cluster_node.protocol.contract import CONTAINER_SSH_PORT, REQUIRED_OUTPUTS

DEFAULT_INVENTORY = Path(".cluster/inventory.json")
DEFAULT_OUTPUTS = Path("cdk-outputs.json")


class InventoryError(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    rank: int
    name: str
    public_ip: str  # the address fab reaches: public IP, or the instance id through a proxy command
    private_ip: str
    instance_id: Optional[str] = None


# access=ssm: fab reaches each node's container sshd (host network, 4444) through Session Manager.
SSM_PROXY_COMMAND = (
    "aws ssm start-session --region {region} --target %h --document-name AWS-StartSSHSession --parameters portNumber=%p"
)


@dataclass(frozen=True)
class SshSettings:
    user: str
    port: int
    key_file: str
    known_hosts: str
    proxy_command: Optional[str] = None  # ssh's ProxyCommand, %h the node's address, %p the port

    def proxy_for(self, host: str) -> Optional[str]:
        if not self.proxy_command:
            return None
        return self.proxy_command.replace("%h", host).replace("%p", str(self.port))


@dataclass(frozen=True)
class Inventory:
    cluster: str
    source: str  # "aws" or "local"
    nodes: list[Node]
    gpus_per_node: int
    ssh: SshSettings
    python: str = "python"
    code_dir: str = "/workspace/train"
    data_dir: str = "/data"
    instance_type: str = ""
    region: Optional[str] = None
    stack_name: Optional[str] = None
    local_state: Optional[str] = None
    extra: dict = field(default_factory=dict)
    file_system_id: Optional[str] = None
    usd_per_hour: Optional[float] = None  # per node, kept from `fab inventory` (None: unknown)
    price_source: str = ""
    spot: bool = False  # Spot nodes (stack output Spot): `fab cost` prices them at the Spot price

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def cluster_ssh_config(self) -> str:
        return f"{self.data_dir}/{clusterdir.CLUSTER}/{clusterdir.SSH_DIR}/config"

    def select(self, count: Optional[int], exclude: tuple[str, ...] = ()) -> list[Node]:
        """The first `count` nodes (all: None) of those not excluded (ranks or names)."""
        left = [node for node in self.nodes if node.name not in self.resolve(exclude)]
        if not left:
            raise InventoryError(f"invalid --exclude {','.join(exclude)}: it leaves no node to train on")
        if count is None:
            return left
        if not 1 <= count <= len(left):
            where = (
                f"{len(left)} node(s) are left after --exclude" if exclude else f"the cluster has {len(left)} node(s)"
            )
            raise InventoryError(f"invalid --nodes {count}: {where}")
        return left[:count]

    def resolve(self, names_or_ranks: tuple[str, ...]) -> set[str]:
        """Node names for ranks ("1") or names ("node1"); one line naming an unknown one."""
        by_key = {str(node.rank): node.name for node in self.nodes} | {node.name: node.name for node in self.nodes}
        unknown = [key for key in names_or_ranks if key not in by_key]
        if unknown:
            known = ", ".join(f"{node.rank}={node.name}" for node in self.nodes)
            raise InventoryError(f"invalid --exclude {','.join(unknown)}: no such node (the nodes: {known})")
        return {by_key[key] for key in names_or_ranks}

    def node(self, key: str, flag: str = "--node") -> Node:
        """The node of a rank ("1") or a name ("node1"), as --exclude takes them; one line otherwise."""
        found = [node for node in self.nodes if key in (str(node.rank), node.name)]
        if not found:
            known = ", ".join(f"{node.rank}={node.name}" for node in self.nodes)
            raise InventoryError(f"invalid {flag} {key}: no such node (the nodes: {known})")
        return found[0]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Inventory":
        if not path.exists():
            raise InventoryError(
                f"no inventory at {path}: run `fab local.up` (emulated cluster) or "
                "`npx cdk deploy` then `fab inventory` (AWS)"
            )
        try:
            raw = json.loads(path.read_text())
            raw["nodes"] = [Node(**n) for n in raw["nodes"]]
            raw["ssh"] = SshSettings(**raw["ssh"])
            inventory = cls(**raw)
        except (ValueError, TypeError, KeyError) as error:
            raise InventoryError(
                f"unreadable inventory {path} ({error}); rebuild it with `fab inventory` or `fab local.up`"
            ) from None
        if not inventory.nodes:
            raise InventoryError(f"inventory {path} lists no nodes; rebuild it with `fab inventory`")
        return inventory


def write_known_hosts(path: Path, hosts: list[str], host_public_key: str, port: int) -> None:
    """Exact `[ip]:port` lines (paramiko ignores wildcard patterns)."""
    key = " ".join(host_public_key.split()[:2])
    path.write_text("".join(f"[{host}]:{port} {key}\n" for host in hosts))
    os.chmod(path, 0o600)


def stack_outputs_from_file(path: Path) -> tuple[str, dict]:
    """(stack name, outputs) of the one GPU cluster stack in a `cdk deploy --outputs-file` file."""
    if not path.exists():
        raise InventoryError(f"no {path}: run `npx cdk deploy` first (cdk.json makes it write the outputs there)")
    data = json.loads(path.read_text())
    stacks = {name: out for name, out in data.items() if "PrivateIps" in out}
    if len(stacks) != 1:
        raise InventoryError(f"{path} holds {len(stacks)} cluster stacks; pass --stack NAME")
    return next(iter(stacks.items()))


def stack_outputs_from_aws(stack_name: str, session) -> dict:
    client = session.client("cloudformation")
    try:
        stack = client.describe_stacks(StackName=stack_name)["Stacks"][0]
    except client.exceptions.ClientError as error:
        raise InventoryError(f"cannot describe stack {stack_name}: {error}") from None
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}


def from_outputs(
    stack_name: str,
    outputs: dict,
    session,
    state_dir: Path,
    key_file: Optional[str] = None,
    key_dir: Optional[Path] = None,
) -> Inventory:
    """Build the inventory of a deployed stack: the private key is fetched from SSM once into
    key_dir (0600), the host key is pinned in state_dir/STACK.known_hosts."""
    missing = [k for k in REQUIRED_OUTPUTS if k not in outputs]
    if missing:
        raise InventoryError(
            f"stack {stack_name} outputs lack {', '.join(missing)}: redeploy with this version (`npx cdk deploy`)"
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    ssm = session.client("ssm")
    key_file = key_file or _fetch_private_key(ssm, stack_name, outputs, key_dir or Path.home() / ".ssh")
    host_key = _published_host_key(ssm, outputs)
    proxy = SSM_PROXY_COMMAND.format(region=outputs.get("Region") or "us-east-1") if _via_ssm(outputs) else None
    nodes = refresh_addresses(_nodes(outputs), session.client("ec2"), via_ssm=proxy is not None)
    known_hosts = state_dir / f"{stack_name}.known_hosts"
    write_known_hosts(known_hosts, [n.public_ip for n in nodes], host_key, port=CONTAINER_SSH_PORT)
    return Inventory(
        cluster=outputs.get("ClusterName", stack_name),
        source="aws",
        nodes=nodes,
        gpus_per_node=int(outputs["GpusPerNode"]),
        ssh=SshSettings(
            user="root", port=CONTAINER_SSH_PORT, key_file=key_file, known_hosts=str(known_hosts), proxy_command=proxy
        ),
        instance_type=outputs.get("InstanceType", ""),
        region=outputs.get("Region"),
        stack_name=stack_name,
        file_system_id=outputs.get("FileSystemId"),
        spot=outputs.get("Spot") == "true",
        extra={
            key: value
            for key, value in (
                ("dashboard_url", outputs.get("DashboardUrl")),
                ("efa_cards", int(outputs.get("EfaCards") or 0)),
            )
            if value
        },
    )


def _via_ssm(outputs: dict) -> bool:
    return outputs.get("Access") == "ssm"


def _fetch_private_key(ssm, stack_name: str, outputs: dict, key_dir: Path) -> str:
    """The key pair CDK created, fetched from SSM once into key_dir (0600)."""
    if outputs["KeyParameterName"] == "none":
        raise InventoryError("the stack uses your own key pair: pass --key-file PATH")
    key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Named after the key pair's parameter (/ec2/keypair/key-ID): a new deploy of the same stack
    # has a new key pair, so a key file left by an earlier deploy is never reused.
    key_id = outputs["KeyParameterName"].rstrip("/").rsplit("/", 1)[-1]
    key_path = key_dir / f"{stack_name}-{key_id}.pem"
    if not key_path.exists():
        value = ssm.get_parameter(Name=outputs["KeyParameterName"], WithDecryption=True)["Parameter"]["Value"]
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(value if value.endswith("\n") else value + "\n")
    return str(key_path)


def _published_host_key(ssm, outputs: dict) -> str:
    try:
        host_key = ssm.get_parameter(Name=outputs["HostKeyParameterName"])["Parameter"]["Value"]
    except ssm.exceptions.ParameterNotFound:
        host_key = ""
    if not host_key.startswith("ssh-"):  # the stack's placeholder until node 0 has booted
        raise InventoryError(
            "the nodes have not published their host key yet: wait for "
            "`cdk deploy` to finish, then run `fab inventory` again"
        )
    return host_key


def _nodes(outputs: dict) -> list[Node]:
    """Nodes in rank order, addressed by instance id (access=ssm: Session Manager resolves it), else
    by public IP, else (no public address, e.g. an emulator) by private IP."""
    private = outputs["PrivateIps"].split(",")
    public = outputs["PublicIps"].split(",")
    ids = outputs["InstanceIds"].split(",")
    if _via_ssm(outputs):
        public = list(ids)
    else:
        public = [
            ip if ip and ip not in ("None", "none") else private[r]
            for r, ip in enumerate(public + [""] * (len(private) - len(public)))
        ]
    return [
        Node(rank=r, name=f"node{r}", public_ip=public[r], private_ip=private[r], instance_id=ids[r])
        for r in range(len(private))
    ]


def describe(ec2, ids: list[str]) -> dict[str, dict]:
    """Instance id -> its description, for the ids that still exist (a filter, not InstanceIds:
    an id that is gone is left out instead of failing the call)."""
    if not ids:
        return {}
    pages = ec2.get_paginator("describe_instances").paginate(Filters=[{"Name": "instance-id", "Values": ids}])
    return {i["InstanceId"]: i for page in pages for r in page["Reservations"] for i in r["Instances"]}


def refresh_addresses(nodes: list[Node], ec2, via_ssm: bool = False) -> list[Node]:
    """The nodes with the addresses EC2 reports now (a stop/start changes public IPs); a node without
    a public address (private subnet, an emulator) is reached on its private one. Reached through
    Session Manager (via_ssm), a node keeps its instance id as its address: that is its target."""
    described = describe(ec2, [n.instance_id for n in nodes if n.instance_id])
    fresh = []
    for node in nodes:
        instance = described.get(node.instance_id or "", {})
        private = instance.get("PrivateIpAddress") or node.private_ip
        public = instance.get("PublicIpAddress") or (node.public_ip if node.public_ip not in ("", "None") else "")
        if instance.get("State", {}).get("Name") == "stopped":  # its last public address is gone with the stop
            public = ""
        if via_ssm and node.instance_id:
            public = node.instance_id
        fresh.append(replace(node, private_ip=private, public_ip=public or private))
    return fresh
