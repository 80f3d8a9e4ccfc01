"""An emulated multi-node cluster on one machine (root only).

Each node is a network namespace with its own address on a bridge, a private UTS + mount namespace
(own hostname, /etc/hosts listing every node, /run on tmpfs, the shared directory at /data), and the
training container's own entrypoint running sshd on 4444. Links can be capped with `tc tbf`.
`up` writes the same inventory format as a deployed stack, so every fab task works unchanged.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from cluster_node.protocol import clusterdir, rundir
from cluster_node.protocol.contract import CONTAINER_SSH_PORT
from clusterops.inventory import Inventory, Node, SshSettings, write_known_hosts
from clusterops.local import net as localnet
from clusterops.local.data import describe_data, unfetched_runs
from clusterops.local.net import LocalClusterError

__all__ = ["describe_data", "unfetched_runs"]  # re-exported: the fab tasks read them here

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "assets" / "docker" / "entrypoint.sh"
IDENTITY_SCRIPT = REPO / "assets" / "docker" / "cluster-identity.sh"
SSHD_CONFIG = REPO / "assets" / "docker" / "sshd_config"
HOST_BASHRC = os.path.expanduser("~root/.bashrc")
REQUIRED_TOOLS = ("ip", "tc", "unshare", "nsenter", "taskset", "sshd", "ssh", "ssh-keygen", "mpirun", "mount")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")
STATE_ROOT = Path(os.environ.get("GPU_CLUSTER_LOCAL_STATE", "/var/tmp/gpu-cluster-local"))


@dataclass(frozen=True)
class LocalSpec:
    name: str = "local"
    nodes: int = 2
    slots: int = 1
    link: str | None = None
    subnet: str = "10.213.0.0/24"
    data_dir: str = "/data"

    def validate(self) -> None:
        if not re.match(r"^[a-z][a-z0-9]{0,7}$", self.name):
            raise LocalClusterError(
                f"invalid --name {self.name!r}: 1-8 lowercase letters/digits, starting with a letter"
            )
        if not 1 <= self.nodes <= 32:
            raise LocalClusterError(f"invalid --nodes {self.nodes}: expected 1 to 32")
        if not 1 <= self.slots <= 16:
            raise LocalClusterError(f"invalid --slots {self.slots}: expected 1 to 16")
        if self.link is not None and not _RATE.match(self.link):
            raise LocalClusterError(f"invalid --link {self.link!r}: a tc rate such as 1gbit or 500mbit")
        try:
            network = ipaddress.ip_network(self.subnet)
        except ValueError:
            raise LocalClusterError(f"invalid --subnet {self.subnet!r}: an IPv4 CIDR such as 10.213.0.0/24") from None
        if network.version != 4 or network.num_addresses < self.nodes + 16:
            raise LocalClusterError(f"invalid --subnet {self.subnet!r}: IPv4 with room for {self.nodes} nodes")
        if not self.data_dir.startswith("/") or self.data_dir == "/":
            raise LocalClusterError(f"invalid --data-dir {self.data_dir!r}: an absolute path, not /")

    @property
    def bridge(self) -> str:
        return f"gcbr-{self.name}"

    @property
    def bridge_ip(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    @property
    def prefix(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen

    def node_ip(self, rank: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[10 + rank])

    def netns(self, rank: int) -> str:
        return f"gc-{self.name}-node{rank}"

    def host_veth(self, rank: int) -> str:
        return f"gcv-{self.name}-{rank}"

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.name


def preflight() -> None:
    if os.geteuid() != 0:
        raise LocalClusterError(
            "the local cluster needs root (network and mount namespaces); run as root, e.g. `sudo fab local.up`"
        )
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        raise LocalClusterError(
            f"missing tools: {', '.join(missing)}; run `make setup` "
            "(apt: iproute2 openssh-server openmpi-bin util-linux)"
        )


def _wait_for_port(ip: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((ip, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise LocalClusterError(f"sshd on {ip}:{port} did not come up in {timeout:.0f} s")


def _node_script(
    spec: LocalSpec,
    rank: int,
    hosts_file: Path,
    nsswitch: Path,
    shared: Path,
    extra_keys: Path,
    image_env: Mapping[str, str],
) -> str:
    # Like a container's, the entrypoint's environment is the image's only (env -i), not the host's.
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": "/root",
        **image_env,
        "DATA_DIR": spec.data_dir,
        "RUNTIME_DIR": "/run/gpu-cluster",
        # The trainer's in-memory snapshot in this node's own /run (a tmpfs per node): nodes share /dev/shm.
        rundir.SNAPSHOT_DIR_ENV: "/run/gpu-cluster/snapshots",
        "EXTRA_AUTHORIZED_KEYS": str(extra_keys),
        "SSHD_CONFIG": str(SSHD_CONFIG),
    }
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    q = shlex.quote
    return "; ".join(
        [
            "set -e",
            f"hostname node{rank}",
            f"mount --bind {q(str(hosts_file))} /etc/hosts",
            f"mount --bind {q(str(nsswitch))} /etc/nsswitch.conf",
            "mount -t tmpfs -o mode=0755 tmpfs /run",
            f"mount --bind {q(str(shared))} {q(spec.data_dir)}",
            # The image's home, not this machine's: sshd's bash sources ~/.bashrc for every command
            # (here pyenv's init: 130 ms of CPU per command, which 32 nodes on 2 cores pay in turn).
            f"if [ -f {q(HOST_BASHRC)} ]; then mount --bind {q(str(spec.state_dir / 'bashrc'))} {q(HOST_BASHRC)}; fi",
            f"exec env -i {exports} bash {q(str(ENTRYPOINT))}",
        ]
    )


class NothingToDo(LocalClusterError):
    """`local.down` of a cluster that is not there: said, not an error."""


def up(
    spec: LocalSpec, inventory_path: Path, replace: bool = False, image_env: Mapping[str, str] | None = None
) -> Inventory:
    """Bring the cluster up and write the inventory. A running cluster of the same name (and its
    shared /data) is replaced only when asked to. image_env: variables the training image would set
    (ENV), given to each node's entrypoint."""
    spec.validate()
    preflight()
    if spec.state_dir.exists():
        if not replace:
            raise LocalClusterError(
                f"a local cluster {spec.name!r} is already up; its /data ({spec.state_dir / 'shared'}) "
                f"holds {describe_data(spec.state_dir / 'shared')}: `fab local.up --replace` deletes "
                "it and starts anew, `fab local.down` stops it"
            )
        down(spec.name, inventory_path=None)
    record = _prepare_state(spec)
    shared = spec.state_dir / "shared"
    controller = spec.state_dir / "controller"
    ssh_dir = _make_identities(spec, shared, controller)
    _make_network(spec)
    for rank in range(spec.nodes):
        record["pids"][str(rank)] = _start_node(spec, rank, shared, controller, image_env or {})
        _save_record(spec, record)
    _wait_ready(spec, shared)
    return _write_inventory(spec, ssh_dir, controller, inventory_path)


def _prepare_state(spec: LocalSpec) -> dict:
    for directory in (spec.state_dir / "shared", spec.state_dir / "controller"):
        directory.mkdir(parents=True, exist_ok=True)
    os.chmod(spec.state_dir / "controller", 0o700)
    created_mountpoint = not Path(spec.data_dir).exists() or any(
        json.loads((STATE_ROOT / other / "cluster.json").read_text()).get("created_mountpoint")
        for other in list_clusters()
    )
    Path(spec.data_dir).mkdir(parents=True, exist_ok=True)
    record = {"spec": spec.__dict__, "created_mountpoint": created_mountpoint, "pids": {}}
    _save_record(spec, record)
    return record


def _make_identities(spec: LocalSpec, shared: Path, controller: Path) -> Path:
    """The cluster's SSH identity on shared storage, exactly as the AWS bootstrap makes it on EFS,
    the controller's (fab's) key, and the nodes' /etc/hosts and nsswitch.conf."""
    localnet.run("bash", str(IDENTITY_SCRIPT), str(shared), f"{spec.name}-local")
    localnet.run(
        "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fab-controller", "-f", str(controller / "id_ed25519")
    )
    ssh_dir = shared / clusterdir.CLUSTER / clusterdir.SSH_DIR
    # The script named the host-side path; inside the nodes the shared directory is data_dir.
    config = (ssh_dir / "config").read_text().replace(str(shared), spec.data_dir)
    (ssh_dir / "config").write_text(config)
    hosts = "127.0.0.1 localhost\n" + "".join(f"{spec.node_ip(r)} node{r}\n" for r in range(spec.nodes))
    (spec.state_dir / "hosts").write_text(hosts)
    (spec.state_dir / "bashrc").write_text("# the training image's ~/.bashrc: nothing to run per command\n")
    (spec.state_dir / "nsswitch.conf").write_text("hosts: files\npasswd: files\ngroup: files\nshadow: files\n")
    return ssh_dir


def _make_network(spec: LocalSpec) -> None:
    """A bridge with an address (fab reaches the nodes through it); per node a namespace and veth."""
    localnet.make_bridge(spec.bridge, f"{spec.bridge_ip}/{spec.prefix}")
    for rank in range(spec.nodes):
        cidr = f"{spec.node_ip(rank)}/{spec.prefix}"
        localnet.make_node_network(spec.netns(rank), spec.host_veth(rank), spec.bridge, cidr, spec.link)


def node_cpus(rank: int, nodes: int, cpus: list[int]) -> list[int]:
    """The machine's CPUs node `rank` may use: an equal slice each. A node does not borrow another's cores,
    as real nodes cannot: without this, one node alone ran on every core and scaling looked worse than it
    is. More nodes than CPUs: every node shares all of them, an equal share each (round-robin gave a
    3-node cluster on 2 cores nodes of 1/2, 1 and 1/2 a core: every synchronous step waited on the two
    that shared one while the third core idled half the time)."""
    if nodes > len(cpus):
        return list(cpus)
    per = len(cpus) // nodes
    return cpus[rank * per : (rank + 1) * per]


def _start_node(spec: LocalSpec, rank: int, shared: Path, controller: Path, image_env: Mapping[str, str]) -> int:
    """The node's own UTS and mount namespaces and CPU slice, then the container's entrypoint (sshd on 4444)."""
    log = open(spec.state_dir / f"node{rank}.log", "ab")
    script = _node_script(
        spec,
        rank,
        spec.state_dir / "hosts",
        spec.state_dir / "nsswitch.conf",
        shared,
        controller / "id_ed25519.pub",
        image_env,
    )
    cpus = node_cpus(rank, spec.nodes, sorted(os.sched_getaffinity(0)))
    process = subprocess.Popen(
        [
            "taskset",
            "--cpu-list",
            ",".join(map(str, cpus)),
            "ip",
            "netns",
            "exec",
            spec.netns(rank),
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "--",
            "bash",
            "-c",
            script,
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    return process.pid


def _wait_ready(spec: LocalSpec, shared: Path) -> None:
    for rank in range(spec.nodes):
        _wait_for_port(spec.node_ip(rank), CONTAINER_SSH_PORT, timeout=15)
        ready = shared / clusterdir.CLUSTER / clusterdir.READY_DIR
        ready.mkdir(parents=True, exist_ok=True)
        (ready / clusterdir.NODE_MARK.format(rank=rank)).write_text(
            time.strftime("%Y-%m-%dT%H:%M:%SZ\n", time.gmtime())
        )


def _write_inventory(spec: LocalSpec, ssh_dir: Path, controller: Path, inventory_path: Path) -> Inventory:
    host_key = (ssh_dir / "ssh_host_ed25519_key.pub").read_text()
    known_hosts = controller / "known_hosts"
    nodes = [
        Node(rank=r, name=f"node{r}", public_ip=spec.node_ip(r), private_ip=spec.node_ip(r)) for r in range(spec.nodes)
    ]
    write_known_hosts(known_hosts, [n.public_ip for n in nodes], host_key, port=CONTAINER_SSH_PORT)
    inventory = Inventory(
        cluster=spec.name,
        source="local",
        nodes=nodes,
        gpus_per_node=spec.slots,
        ssh=SshSettings(
            user="root", port=CONTAINER_SSH_PORT, key_file=str(controller / "id_ed25519"), known_hosts=str(known_hosts)
        ),
        python=sys.executable,
        code_dir=str(REPO / "assets" / "train"),
        data_dir=spec.data_dir,
        instance_type="local",
        local_state=str(spec.state_dir),
        extra={"controller_ip": spec.bridge_ip, "link": spec.link},
    )
    inventory.save(inventory_path)
    return inventory


def _save_record(spec: LocalSpec, record: dict) -> None:
    spec.state_dir.mkdir(parents=True, exist_ok=True)
    (spec.state_dir / "cluster.json").write_text(json.dumps(record, indent=2))


def list_clusters() -> list[str]:
    return sorted(p.name for p in STATE_ROOT.glob("*") if (p / "cluster.json").exists())


def down(name: str, inventory_path: Path | None) -> list[str]:
    """Stop every process in the nodes' namespaces, remove namespaces, veths, bridge, mountpoint."""
    preflight()
    state = STATE_ROOT / name
    record_path = state / "cluster.json"
    if not record_path.exists():
        raise NothingToDo(
            f"no local cluster named {name!r} is up (known: {', '.join(list_clusters()) or 'none'}); nothing to do"
        )
    record = json.loads(record_path.read_text())
    spec = LocalSpec(**record["spec"])
    removed = []
    for rank in range(spec.nodes):
        netns = spec.netns(rank)
        if localnet.remove_node_network(netns, spec.host_veth(rank)):
            removed.append(netns)
    for pid in record["pids"].values():
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if localnet.remove_bridge(spec.bridge):
        removed.append(spec.bridge)
    shutil.rmtree(state, ignore_errors=True)
    # rmdir would detach the directory from other clusters' namespaces: only once none is left.
    if record.get("created_mountpoint") and not list_clusters():
        try:
            os.rmdir(spec.data_dir)
        except OSError:
            pass
    if inventory_path is not None and inventory_path.exists():
        current = json.loads(inventory_path.read_text())
        if current.get("source") == "local" and current.get("cluster") == name:
            inventory_path.unlink()
    return removed


def set_link(name: str, rank: int, up_: bool) -> None:
    """Cut or restore one node's link (tests of the watchdog)."""
    record = json.loads((STATE_ROOT / name / "cluster.json").read_text())
    spec = LocalSpec(**record["spec"])
    localnet.run("ip", "link", "set", spec.host_veth(rank), "up" if up_ else "down")


def set_link_rate(name: str, rate: str | None, inventory_path: Path | None = None) -> None:
    """Re-cap (or uncap, rate None) every link of a running cluster; the record and inventory follow."""
    record_path = STATE_ROOT / name / "cluster.json"
    record = json.loads(record_path.read_text())
    spec = LocalSpec(**{**record["spec"], "link": rate})
    spec.validate()
    for rank in range(spec.nodes):
        localnet.cap_node(spec.netns(rank), spec.host_veth(rank), rate)
    record["spec"] = spec.__dict__
    record_path.write_text(json.dumps(record, indent=2))
    if inventory_path is not None and inventory_path.exists():
        inventory = json.loads(inventory_path.read_text())
        if inventory.get("cluster") == name:
            inventory.setdefault("extra", {})["link"] = rate
            inventory_path.write_text(json.dumps(inventory, indent=2))
