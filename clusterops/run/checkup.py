"""`fab check`'s use case: check(inventory, sizes, quick) -> Checked. A probe of every node (GPUs, Xid, ECC,
versions, /data, clock), then, unless quick, the TCP link between every pair and the all-reduce (link.json), the
NCCL transport (kept on /data for `fab train`) and a few real training steps; a health verdict per node."""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from typing import Callable, Optional

from fabric import Connection

from cluster_node.protocol import rundir
from clusterops.inventory import Inventory, InventoryError
from clusterops.nodes import health, remote
from clusterops.nodes import probe as nodeprobe
from clusterops.run import launch, lifecycle, linkcheck

Say = Callable[..., None]
# What a cluster test may raise on purpose (a ValueError too: LaunchError, a bad reading); it becomes a problem.
ERRORS = (InventoryError, remote.RemoteError, ValueError)
ALLREDUCE_MB, PAIR_SECONDS = 64.0, 2  # fab check's defaults: the all-reduce's payload, each pair's TCP test


@dataclass(frozen=True)
class Checked:
    """The verdicts, each node's interface and probe facts, the link and training results, the problems found
    beside the nodes' verdicts, and whether the cluster is fit to train (no bad node, no problem)."""

    verdicts: list
    interfaces: dict
    facts: dict
    link: Optional[dict]
    training: Optional[str]
    problems: list[str]
    fit: bool


def check(inv, sizes: tuple, quick: bool = False, say: Say = print, progress: Say = print) -> Checked:
    """sizes: (all-reduce MB, seconds per pair, TCP streams per pair), None for the defaults. `say`: the link
    test's output; `progress`: what is about to take a while."""
    progress(f"check: probing {len(inv.nodes)} node(s): GPUs, Xid, ECC, versions, /data, clock ...")
    facts, interfaces = nodeprobe.probe_nodes(inv, inv.nodes)
    reachable = [node for node in inv.nodes if facts[node.name] is not None]
    problems: list[str] = []
    link, transport, training = None, {}, None
    if len(set(interfaces.values())) > 1:
        problems.append(f"interfaces differ ({interfaces}); NCCL/GLOO_SOCKET_IFNAME needs one name")
    elif not quick and reachable:
        tests = _cluster_tests(inv, reachable, interfaces, facts, sizes, problems, say, progress)
        link, transport, training = tests
    count, model = health.expected_gpus(inv.instance_type, inv.gpus_per_node)
    expect_efa = bool(inv.extra.get("efa_cards"))
    verdicts = health.assess(facts, count, model, links=_links(link), transport=transport, expect_efa=expect_efa)
    if transport:
        _keep_transport(inv, transport, expect_efa, problems)
    fit = health.fit_to_train(verdicts) and not problems
    return Checked(verdicts, interfaces, facts, link, training, problems, fit)


def _cluster_tests(inv, nodes, interfaces, facts, sizes, problems, say, progress: Say = print):
    """Link matrix + all-reduce (link.json), the transport, the training steps; failures go to problems.
    sizes: (all-reduce MB, seconds per pair, TCP streams per pair), None for the defaults."""
    payload, per_pair, streams = sizes
    gpus = any(facts[n.name]["gpus"] for n in nodes)
    link, transport, training = None, {}, None
    try:
        with remote.connect(inv, inv.head) as conn:
            code_dir = lifecycle.code_dir_on(conn, inv)
            lifecycle.ensure_idle(conn, inv)
            interface = interfaces[nodes[0].name]
            if len(nodes) > 1:
                pairs = len(nodes) * (len(nodes) - 1)
                progress(
                    f"check: the link between {pairs} node pair(s), {per_pair or PAIR_SECONDS} s each, then a "
                    f"{payload or ALLREDUCE_MB:g} MB all-reduce across {len(nodes)} nodes ..."
                )
                link, output = linkcheck.measure(
                    inv, nodes, interface, code_dir, per_pair or PAIR_SECONDS, payload or ALLREDUCE_MB, gpus, streams
                )
                say("\n".join(line for line in output.splitlines() if "NCCL INFO" not in line), flush=True)
                hosts = {facts[n.name]["hostname"]: n.name for n in nodes}
                found = linkcheck.parse_transport(output)
                transport = {hosts.get(h, h): t for h, t in found.items()} if gpus else {}
            if not gpus:
                transport = {n.name: "gloo (no NCCL)" for n in nodes}
            prefix = launch.mpirun_prefix(inv, nodes, interface)
            progress(f"check: a few training steps across {len(nodes)} node(s) ...")
            training = check_training(conn, inv, prefix, code_dir)
    except (*ERRORS, OSError) as error:
        problems.append(f"{type(error).__name__}: {error}" if isinstance(error, OSError) else str(error))
    return link, transport, training


def _keep_transport(inv, transport: dict, expect_efa: bool, problems: list) -> None:
    """The transport verdict on /data, where `fab train` reads it (sockets where EFA was expected refuse)."""
    import json as json_module

    verdict = health.transport_verdict(transport, expect_efa, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    try:
        with remote.connect(inv, inv.head) as conn:
            remote.write_file(conn, health.transport_file(inv), json_module.dumps(verdict, indent=2) + "\n")
    except (*ERRORS, OSError) as error:
        problems.append(f"could not keep the transport verdict for fab train: {error}")


def _links(link) -> dict:
    return {(p["src"], p["dst"]): p["gbit"] for p in (link or {}).get("pairs", [])}


CHECK_STEPS = 3


def check_dir(inventory: Inventory) -> str:
    return f"{inventory.data_dir}/{rundir.RUNS}/{rundir.CHECK_RUN}"


def check_argvs(inventory: Inventory, code_dir: str) -> tuple[list[str], list[str]]:
    """`fab check`'s training steps: train.prepare for a tiny numbers set, then train.train for CHECK_STEPS
    steps and an eval (every collective the trainer uses), both in check_dir."""
    scratch = check_dir(inventory)
    prepare = [
        *launch.node_program(inventory, code_dir, "prepare"),
        "numbers",
        "--out",
        f"{scratch}/numbers",
        "--train",
        "1000",
        "--valid",
        "16",
        "--test",
        "8",
        "--vocab",
        "200",
    ]
    train = [
        *launch.rank_program(inventory, code_dir, "train"),
        "--recipe",
        "transformer-tiny",
        "--data",
        f"{scratch}/numbers",
        "--run-dir",
        f"{scratch}/run",
        "--max-steps",
        str(CHECK_STEPS),
        "--batch-per-gpu",
        "4",
        "--eval-every",
        str(CHECK_STEPS),
        "--eval-samples",
        "8",
        "--log-every",
        "1",
        "--dist-timeout-s",
        "120",
    ]
    return prepare, train


def check_training(connection: Connection, inventory: Inventory, prefix: list[str], code_dir: str) -> str:
    """A few real training steps across the cluster with the trainer's own collectives (step counts,
    DDP, loss, eval, all_gather_object) on a tiny data set in a scratch directory, removed after."""
    scratch = check_dir(inventory)
    prepare, train = check_argvs(inventory, code_dir)
    try:
        remote.sh(connection, f"rm -rf {shlex.quote(scratch)} && mkdir -p {shlex.quote(scratch)}")
        remote.sh(connection, "timeout 300 " + shlex.join(prepare))
        result = connection.run("timeout 600 " + shlex.join(prefix + train), hide=True, warn=True, in_stream=False)
    finally:
        remote.sh(connection, f"rm -rf {shlex.quote(scratch)}", check=False)
    summary = [line for line in result.stdout.splitlines() if line.startswith("summary: ")]
    if result.exited != 0 or not summary:
        why = lifecycle._failure_line(result.stderr + result.stdout)
        raise remote.RemoteError(f"the training steps failed (exit {result.exited}): {why}")
    ranks = len(inventory.nodes) * inventory.gpus_per_node
    return (
        f"training: {CHECK_STEPS} steps on {ranks} ranks with the trainer's collectives: ok "
        f"({summary[-1][len('summary: ') :]})"
    )
