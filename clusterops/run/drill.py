"""`fab drill KIND`: inject one failure into the running job, wait for the supervisor to act, then say
what it did, the incident's timeline and the goodput it cost. The injections are the ones the failure
tests used privately (tests/test_restarts_cluster.py, test_local_cluster.py), as plain functions.

On the emulated cluster each node is a network namespace of this machine (root): its processes are
`ip netns pids`, its link is the host-side veth, and a Spot notice comes from an IMDS stand-in on the
controller's bridge address. On AWS only `stop-rank` runs (over SSH into the container); the others
are refused in one line (AWS_REFUSALS; docs/operations.md, "Failure drills", gives their AWS cost)."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from cluster_node.protocol import clusterdir, phases, rundir
from clusterops.inventory import Inventory
from clusterops.local import cluster as localcluster
from clusterops.local import net as localnet
from clusterops.nodes import records as noderecords
from clusterops.nodes import remote
from clusterops.run import lifecycle

KINDS = {
    "kill-node": "SIGKILL every process of a node (sshd, MPI daemon, rank): a lost node",
    "cut-link": "take a node's link down until the supervisor has acted, then up again",
    "slow-link": "cap a node's link at --rate for --seconds (tc tbf), then restore it",
    "stop-rank": "SIGSTOP a node's rank (a hang), SIGCONT once the supervisor has acted",
    "spot": "a Spot stop notice for a node, from the emulated IMDS to its Spot watcher",
    "fill-data": "a --mb file on /data for --seconds, removed afterwards",
}
AWS_SAFE = ("stop-rank",)  # over SSH into the container; the supervisor undoes it (hang -> restart)
# Why not the others on AWS. fab reaches only the container's sshd; the container runs with Docker's
# default capabilities plus SYS_PTRACE (node-bootstrap.sh), and Docker's default set has no NET_ADMIN
# (Docker run reference, "Runtime privilege and Linux capabilities"): no tc, no `ip link` there. EC2's
# IMDS cannot be told to send a notice; the EC2 console / AWS FIS can ("Initiate a Spot Instance
# interruption", EC2 User Guide: the notice, then the interruption two minutes later, for real).
AWS_REFUSALS = {
    "kill-node": "fab reaches only the node's container, not its host; the real drill is stopping that "
    "instance (`aws ec2 stop-instances`), which leaves it stopped until `fab start`",
    "cut-link": "the container has no NET_ADMIN (no `ip link`), and a cut link would cut fab's SSH to the node too",
    "slow-link": "the container has no NET_ADMIN, so no tc",
    "spot": "EC2's IMDS cannot be told to send a notice; the EC2 console's \"Initiate interruption\" (AWS FIS) "
    "does, and really interrupts the node two minutes later",
    "fill-data": "/data is EFS, which grows elastically and never fills; trying bills every GB written",
}
HEAD_REFUSED = ("kill-node", "cut-link")  # node0 runs the supervisor: nothing would be left to act
HOLDS = ("slow-link", "fill-data")  # undone after --seconds; the others once the supervisor has acted
# A rank's command line (pgrep -f, ERE): python first, so not mpirun's line nor pgrep's own shell.
RANK_PATTERN = "^[^ ]*python[^ ]* -m train[.]train --recipe"


class DrillError(RuntimeError):
    pass


@dataclass(frozen=True)
class Drill:
    kind: str
    node: Optional[int] = None  # default: the last node
    seconds: float = 30.0  # slow-link, fill-data: how long the fault holds
    rate: str = "10mbit"  # slow-link
    mb: int = 256  # fill-data: the file's size
    wait: float = 180.0  # the longest wait for the supervisor

    def target(self, inventory: Inventory) -> int:
        return len(inventory.nodes) - 1 if self.node is None else self.node


def check_options(drill: Drill) -> None:
    """The options alone, before any inventory or node is read: one line each."""
    if drill.kind not in KINDS:
        raise DrillError(f"invalid drill {drill.kind!r}: one of {', '.join(KINDS)} (`fab --help drill`)")
    if not 1 <= drill.seconds <= 600 or not 1 <= drill.wait <= 1800:
        raise DrillError(f"invalid --seconds {drill.seconds:g} / --wait {drill.wait:g}: 1-600 and 1-1800 seconds")
    if not 1 <= drill.mb <= 65536:
        raise DrillError(f"invalid --mb {drill.mb}: 1 to 65536 (the file is removed afterwards)")
    if drill.kind == "slow-link" and not localcluster._RATE.match(drill.rate):
        raise DrillError(f"invalid --rate {drill.rate!r}: a tc rate such as 10mbit")


def validate(drill: Drill, inventory: Inventory) -> None:
    """One line for bad input or a drill that is not safe here; nothing has been touched yet."""
    check_options(drill)
    if inventory.source == "aws" and drill.kind not in AWS_SAFE:
        raise DrillError(
            f"drill {drill.kind} is not run on AWS: {AWS_REFUSALS[drill.kind]}; rehearse it on the emulated "
            f"cluster (`fab local.up`); on AWS only {', '.join(AWS_SAFE)}"
        )
    node = drill.target(inventory)
    if not 0 <= node < len(inventory.nodes):
        raise DrillError(f"invalid --node {node}: the cluster has nodes 0 to {len(inventory.nodes) - 1}")
    if node == 0 and drill.kind in HEAD_REFUSED:
        raise DrillError(f"drill {drill.kind} on node0 would take the supervisor with it: give --node 1 or more")
    if len(inventory.nodes) < 2 and drill.kind != "fill-data":
        raise DrillError(f"drill {drill.kind} needs 2 nodes or more (the survivors carry on)")


# ---------------------------------------------------------------- the injections


def _spec(inventory: Inventory) -> localcluster.LocalSpec:
    record = localcluster.STATE_ROOT / inventory.cluster / "cluster.json"
    if not record.exists():
        raise DrillError(f"no local cluster named {inventory.cluster!r} is up on this machine")
    return localcluster.LocalSpec(**json.loads(record.read_text())["spec"])


def _namespace_pids(inventory: Inventory, node: int, pattern: str = "") -> list[int]:
    """The node's processes (those whose command line matches `pattern`, when given)."""
    netns = _spec(inventory).netns(node)
    pids = [int(p) for p in localnet.run("ip", "netns", "pids", netns).stdout.split()]
    if not pattern:
        return pids
    found = []
    for pid in pids:
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if re.search(pattern, cmdline):
            found.append(pid)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def kill_node(inventory: Inventory, drill: Drill) -> Iterator[str]:
    pids = _namespace_pids(inventory, drill.target(inventory))
    _signal(pids, signal.SIGKILL)
    yield f"SIGKILL to its {len(pids)} processes (`fab local.up --repair --name {inventory.cluster}` restarts it)"


@contextlib.contextmanager
def cut_link(inventory: Inventory, drill: Drill) -> Iterator[str]:
    node = drill.target(inventory)
    localcluster.set_link(inventory.cluster, node, up_=False)
    try:
        yield f"its link ({_spec(inventory).host_veth(node)}) down"
    finally:
        localcluster.set_link(inventory.cluster, node, up_=True)


@contextlib.contextmanager
def slow_link(inventory: Inventory, drill: Drill) -> Iterator[str]:
    spec, node = _spec(inventory), drill.target(inventory)
    for device, netns in ((spec.host_veth(node), None), ("eth0", spec.netns(node))):
        localnet.cap(device, drill.rate, netns)
    try:
        yield f"its link capped at {drill.rate} both ways for {drill.seconds:.0f} s"
    finally:
        for device, netns in ((spec.host_veth(node), None), ("eth0", spec.netns(node))):
            if spec.link:  # the cluster's own cap, as `fab local.up --link` set it
                localnet.cap(device, spec.link, netns)
            else:
                prefix = ("ip", "netns", "exec", netns) if netns else ()
                localnet.run(*prefix, "tc", "qdisc", "del", "dev", device, "root", check=False)


@contextlib.contextmanager
def stop_rank(inventory: Inventory, drill: Drill) -> Iterator[str]:
    """SIGSTOP one rank of the node, its oldest (local rank 0 on a multi-GPU node; its data workers, forked
    with its command line, are younger); SIGCONT afterwards (Open MPI sends one before its SIGTERM too)."""
    node = inventory.nodes[drill.target(inventory)]
    with remote.connect(inventory, node) as conn:
        if inventory.source == "local":  # the namespaces share this machine's PIDs: pgrep sees every node's
            pids = sorted(_namespace_pids(inventory, node.rank, RANK_PATTERN))[:1]
        else:
            pids = [int(p) for p in remote.sh(conn, f"pgrep -o -f {remote.q(RANK_PATTERN)} || true").split()]
        if not pids:
            raise DrillError(f"no trainer process on {node.name}: is the run stepping there?")

        def send(sig: signal.Signals) -> None:
            if inventory.source == "local":
                return _signal(pids, sig)
            remote.sh(conn, f"kill -{sig.name[3:]} {' '.join(map(str, pids))} 2>/dev/null || true", check=False)

        send(signal.SIGSTOP)
        try:
            yield f"SIGSTOP to its rank (pid {', '.join(map(str, pids))})"
        finally:
            send(signal.SIGCONT)


@contextlib.contextmanager
def spot(inventory: Inventory, drill: Drill) -> Iterator[str]:
    """A Spot watcher in the node's namespace polls the IMDS stand-in; the notice says stop in 120 s."""
    from clusterops.local.imds import serve_imds

    spec, node = _spec(inventory), drill.target(inventory)
    with serve_imds(spec.bridge_ip) as imds:
        watcher = subprocess.Popen(
            ["ip", "netns", "exec", spec.netns(node), sys.executable, "-m", "cluster_node.daemons.spotwatch"]
            + ["--data", str(spec.state_dir / "shared"), "--interval", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "AUTOSTOP_IMDS_URL": imds.url, "NODE_RANK": str(node), "INSTANCE_ID": f"i-0node{node}"},
        )
        try:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
            imds.instance_action = {"action": "stop", "time": when}
            yield f"Spot notice `stop at {when}` from the IMDS stand-in {imds.url} to its Spot watcher"
        finally:
            watcher.kill()
            watcher.wait()


@contextlib.contextmanager
def fill_data(inventory: Inventory, drill: Drill) -> Iterator[str]:
    """A bounded file (fallocate, else zeros) on /data from the node, removed however the drill ends."""
    node = inventory.nodes[drill.target(inventory)]
    path = posixpath.join(inventory.data_dir, clusterdir.CLUSTER, clusterdir.DRILL_FILL.format(host=node.name))
    with remote.connect(inventory, node) as conn:
        size = f"{drill.mb}M"
        write = f"fallocate -l {size} {path} 2>/dev/null || head -c {size} /dev/zero > {path} || true"
        try:
            remote.sh(conn, write)
            free = remote.sh(conn, f"df -Pm {inventory.data_dir} | tail -1").split()
            left = int(free[3]) if len(free) > 3 and free[3].isdigit() else None
            full = "/data is full" if left == 0 else f"{left} MB still free: a larger --mb fills it"
            yield f"{drill.mb} MB in {path} for {drill.seconds:.0f} s ({full})"
        finally:
            remote.sh(conn, f"rm -f {path}", check=False)


INJECTIONS: dict[str, Callable] = {
    "kill-node": kill_node,
    "cut-link": cut_link,
    "slow-link": slow_link,
    "stop-rank": stop_rank,
    "spot": spot,
    "fill-data": fill_data,
}


# ---------------------------------------------------------------- the run, before and after


@dataclass(frozen=True)
class Watch:
    run_dir: str
    started: float  # the injection's epoch time
    log_offset: int  # train.log's size then: the supervisor's lines after it are the drill's


def _marks(conn, inventory: Inventory, run_dir: str) -> tuple[phases.Phase, ...]:
    return noderecords.read(conn, inventory, run_dir, rundir.PHASES).phases


def acted(marks, since: float) -> Optional[str]:
    """What the supervisor has done since `since`: "ended", "relaunched" (a launch and its first step),
    or None yet."""
    later = [m for m in sorted(marks, key=lambda m: m.time) if m.time >= since]
    if any(m.event == "done" for m in later):
        return "ended"
    launched = next((i for i, m in enumerate(later) if m.event == "launch"), None)
    if launched is not None and any(m.event == "first_step" for m in later[launched:]):
        return "relaunched"
    return None


def await_outcome(conn, inventory: Inventory, watch: Watch, drill: Drill, poll: float = 0.5) -> tuple[str, tuple]:
    """Until the supervisor has acted (or, for a fault held --seconds, that long), at most --wait."""
    deadline = watch.started + (drill.seconds if drill.kind in HOLDS else drill.wait)
    while True:
        marks = _marks(conn, inventory, watch.run_dir)
        outcome = acted(marks, watch.started)
        if outcome == "ended" or (outcome and drill.kind not in HOLDS):
            return outcome, marks
        if time.time() >= deadline:
            return outcome or ("held" if drill.kind in HOLDS else "no action"), marks
        time.sleep(poll)


def await_log_step(conn, inventory: Inventory, run_dir: str, since: float, wait: float, poll: float = 0.5) -> tuple:
    """The marks once a log step (or the run's end) lands after `since`; at most `wait` seconds."""
    deadline = since + wait
    while True:
        marks = _marks(conn, inventory, run_dir)
        if any(m.event in ("steps", "done") and m.time > since for m in marks) or time.time() >= deadline:
            return marks
        time.sleep(poll)


def _furthest_step(conn, run_dir: str) -> Optional[int]:
    """The furthest step a rank has finished (ranks/rankN: `STEP PID HOST`, awk: one line per file)."""
    beats = remote.sh(conn, f"awk '{{print $1}}' {remote.q(run_dir + '/' + rundir.RANKS)}/rank* 2>/dev/null || true")
    return max((int(s) for s in beats.split() if s.isdigit()), default=None)


def rehearse(inventory: Inventory, drill: Drill) -> list[str]:
    """The drill, start to end; the lines to print (clusterops.run.drillreport)."""
    from clusterops.run import drillreport

    validate(drill, inventory)
    if inventory.source == "local" and drill.kind not in ("stop-rank", "fill-data"):
        localcluster.preflight()  # root, ip, tc
    node = inventory.nodes[drill.target(inventory)]
    with remote.connect(inventory, inventory.head) as conn:
        run_dir = lifecycle.active_run(conn, inventory)
        if not run_dir:
            raise DrillError("no run is going: start one (e.g. `fab train --max-restarts 1`), then drill it")
        log = remote.q(f"{run_dir}/{rundir.TRAIN_LOG}")
        offset = int(remote.sh(conn, f"stat -c %s {log} 2>/dev/null || echo 0").strip() or 0)
        step = _furthest_step(conn, run_dir)
        watch = Watch(run_dir, time.time(), offset)
        with INJECTIONS[drill.kind](inventory, drill) as what:
            outcome, marks = await_outcome(conn, inventory, watch, drill)
        if outcome == "held":  # a stall shows in the account only once the next log step lands
            marks = await_log_step(conn, inventory, watch.run_dir, time.time(), drill.wait)
        ended = time.time()
        supervisor_lines = remote.sh(conn, f"tail -c +{offset + 1} {log} 2>/dev/null || true").splitlines()
        found = noderecords.read(conn, inventory, run_dir, rundir.RESTARTS, rundir.RUN_STATUS)
    head = f"drill {drill.kind} on {node.name} ({node.private_ip}), run {run_dir} at step {step}: {what}"
    return drillreport.lines(head, watch, ended, outcome, marks, supervisor_lines, found.restarts, found.status)
