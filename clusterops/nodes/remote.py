"""SSH primitives: connect to a node, run one command, read or write one file, fan out over every node.
What runs over them lives by noun: lifecycle (a run), nodeview (a node), tensorboard."""

from __future__ import annotations

import json
import shlex
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import paramiko
from fabric import Connection

from cluster_node.protocol.contract import FAB_SSH_MARKS
from clusterops.inventory import Inventory, Node

q = shlex.quote


class RemoteError(RuntimeError):
    pass


# Before each command: name this connection, as the node's sshd sees it (SSH_CONNECTION, after any
# NAT), in the container's FAB_SSH_MARKS, so the idle watchdog counts no fab traffic as use (a
# forgotten `fab monitor` sends ~9-18 KB a minute per node). A shell builtin, no process; silent and
# harmless where the folder does not exist (an older image).
MARK = '{ true > "%s/$SSH_CONNECTION"; } 2>/dev/null; '


class MarkedConnection(Connection):
    """A Fabric connection whose commands mark it as fab's (MARK)."""

    marks = FAB_SSH_MARKS

    def run(self, command: str, **kwargs):
        return super().run(MARK % self.marks + command, **kwargs)


def connect(inventory: Inventory, node: Node) -> Connection:
    """A connection that trusts only the pinned host key of the cluster."""
    connection = MarkedConnection(
        host=node.public_ip,
        user=inventory.ssh.user,
        port=inventory.ssh.port,
        connect_timeout=10,
        gateway=inventory.ssh.proxy_for(node.public_ip),
        connect_kwargs={"key_filename": inventory.ssh.key_file, "look_for_keys": False, "allow_agent": False},
    )
    connection.client.get_host_keys().clear()
    connection.client.load_host_keys(inventory.ssh.known_hosts)
    connection.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return connection


def sh(connection: Connection, command: str, check: bool = True, timeout: Optional[float] = None) -> str:
    result = connection.run(command, hide=True, warn=True, in_stream=False, timeout=timeout)
    if check and result.exited != 0:
        raise RemoteError(
            f"{connection.host}: `{command}` exited {result.exited}: {(result.stderr or result.stdout).strip()[-500:]}"
        )
    return result.stdout


def read_json(
    connection: Connection, path: str, strict: bool = False, timeout: Optional[float] = None
) -> Optional[dict]:
    """The file's JSON, None when it is missing; unreadable JSON is None too, or with `strict` an
    error naming the file (a status that never parses must not make a follower wait forever)."""
    text = sh(connection, f"cat {q(path)} 2>/dev/null || true", timeout=timeout)
    try:
        return json.loads(text) if text.strip() else None
    except ValueError as error:
        if strict:
            raise RemoteError(f"{path} is not valid JSON ({error}): {text.strip()[:200]!r}") from None
        return None


def write_file(connection: Connection, path: str, text: str, mode: int = 0o644) -> None:
    """Upload text atomically (temp file + rename) over SFTP."""
    sftp = connection.sftp()
    tmp = f"{path}.tmp"
    with sftp.open(tmp, "w") as handle:
        handle.write(text)
    sftp.chmod(tmp, mode)
    sh(connection, f"mv -f {q(tmp)} {q(path)}")


class Connections:
    """One connection per node for the life of a task, opened on first use and shared by on_all
    and the task's later head-node work: SSH set-up (a Session Manager session with access=ssm)
    is paid once per node, not once per step."""

    def __init__(self, inventory: Inventory):
        self.inventory = inventory
        self._open: dict[int, Connection] = {}
        self._lock = threading.Lock()

    def get(self, node: Node) -> Connection:
        with self._lock:
            if node.rank not in self._open:
                self._open[node.rank] = connect(self.inventory, node)
            return self._open[node.rank]

    def close(self) -> None:
        with self._lock:
            opened, self._open = list(self._open.values()), {}
        for connection in opened:
            connection.close()

    def __enter__(self) -> "Connections":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def failure(error: BaseException) -> str:
    """A node's failure in words: what SSH found (nothing listening, no answer in time) rather than
    paramiko's class name and its "[Errno None]"; any other error as its type and text."""
    if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):
        causes = sorted({getattr(e, "strerror", None) or str(e) for e in error.errors.values()})
        where = ", ".join(sorted({f"{address[0]}:{address[1]}" for address in error.errors}))
        return f"no SSH on {where} ({'; '.join(causes)}): the node, its container or its sshd is down"
    if isinstance(error, TimeoutError):  # socket.timeout: the connect timeout passed without an answer
        return f"no answer from SSH in time ({error or 'timed out'}): the node is down or unreachable"
    return f"{type(error).__name__}: {error}"


def on_all(
    inventory: Inventory,
    nodes: list[Node],
    action: Callable[[Connection, Node], dict],
    connections: Optional[Connections] = None,
) -> list[dict]:
    """Run action(connection, node) on every node at once (one thread per node: the work is waiting
    on the network); an unreachable node is a row too. Pass `connections` to keep them open after."""
    pool = connections or Connections(inventory)

    def one(node: Node) -> dict:
        try:
            connection = pool.get(node)
            return dict(node=node.name, reachable=True, **action(connection, node))
        except Exception as error:  # noqa: BLE001 - report any failure as that node's state
            return dict(node=node.name, reachable=False, error=failure(error)[:160])

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(nodes)))) as pool_threads:
            return list(pool_threads.map(one, nodes))
    finally:
        if connections is None:
            pool.close()
