"""A run's lifecycle on the head node: the claim and start (the supervisor), follow, stop, state,
the runs on /data, and fetching one home. Plain functions taking a connection; SSH is remote's."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import re
import shlex
import shutil
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Optional

from fabric import Connection
from invoke.exceptions import CommandTimedOut

from cluster_node.programs.runs import SUPERVISOR_MODULE
from cluster_node.protocol import clusterdir, rundir
from cluster_node.protocol.clusterdir import STAGED_MARKER, STAGING_MARKER
from cluster_node.protocol.rundir import Progress, RunState, RunStatus
from clusterops import terminal
from clusterops.inventory import Inventory
from clusterops.nodes import command as nodecmd
from clusterops.nodes import health, remote
from clusterops.nodes import records as noderecords
from clusterops.nodes.view import detect_interface
from clusterops.run import launch, logfilter
from train import catalog

q = shlex.quote


def active_run(connection: Connection, inventory: Inventory) -> Optional[str]:
    """The run directory whose launcher is alive on the head node, if any."""
    active = remote.sh(connection, f"cat {q(launch.active_file(inventory))} 2>/dev/null || true").strip()
    if not active:
        return None
    return active if remote.sh(connection, _supervisor_state(active), check=False).strip() == "alive" else None


def ensure_idle(connection: Connection, inventory: Inventory) -> None:
    running = active_run(connection, inventory)
    if running:
        raise remote.RemoteError(
            f"a run is already going in {running}: `fab logs --follow` to watch it, `fab stop` to end it"
        )


def run_state(connection: Connection, inventory: Inventory, run_dir: str) -> noderecords.RunFiles:
    """The run's status, progress, summary and restarts (cluster_node.programs.runs overview's files)."""
    return noderecords.read(connection, inventory, run_dir, *STATE_FILES)


STATE_FILES = (rundir.RUN_STATUS, rundir.PROGRESS, rundir.SUMMARY, rundir.RESTARTS)


def latest_run(connection: Connection, inventory: Inventory) -> Optional[str]:
    """The active run's directory, else the run launched last (by its spec, not by its directory's time,
    which fab fetch and fab report move); None without a run."""
    return noderecords.current_run(connection, inventory)


def run_overview(connection: Connection, inventory: Inventory) -> Optional[tuple[str, noderecords.RunFiles]]:
    """The active (else latest) run and its run_state, or None when there is no run yet: one round
    trip instead of seven (cluster_node.programs.runs overview)."""
    found = noderecords.overview(connection, inventory)
    return None if found is None else (found.run, found)


# On the head node's loopback. Not 6006: ports 6000-6063 are X displays :0-:63, which Open MPI's hwloc
# probes at start-up (a listener there made every mpirun hang).
_EXCEPTION = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception): \S")


def _failure_line(output: str) -> str:
    """The most telling line of a failed run: the first exception a rank raised (the launcher's own
    come after it), else an `error:` line, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    exceptions = [line for line in lines if _EXCEPTION.match(line)]
    errors = [line for line in lines if line.startswith("error:")]
    return (exceptions[:1] or errors[-1:] or lines[-1:] or ["no output"])[0][:400]


# ---------------------------------------------------------------- training


def code_dir_on(conn: Connection, inv: Inventory) -> str:
    """The synced copy on /data when `fab sync` made one, else the image's (or checkout's) program."""
    synced = posixpath.join(nodecmd.synced_root(inv), "train")
    if remote.sh(conn, f"test -f {shlex.quote(synced + '/train.py')} && echo yes || true").strip():
        return synced
    return inv.code_dir


def plan_launch(
    connection: Connection, inventory: Inventory, request: launch.TrainRequest, code_dir: str
) -> launch.LaunchPlan:
    """A launch with no health check (`fab scale`'s runs; `fab train` plans its own, checked)."""
    request.validate()
    nodes = launch.check_nodes(inventory, request)
    return launch.LaunchPlan(request, tuple(nodes), detect_interface(connection, inventory.head), code_dir)


def start_training(connection: Connection, inventory: Inventory, plan: launch.LaunchPlan) -> tuple[str, int]:
    """Write the run spec into the run directory and start the supervisor detached, as planned.
    Returns the run directory and the log's size before this launch (where its output starts)."""
    request = plan.request
    ensure_idle(connection, inventory)
    dataset = request.dataset or launch.default_dataset(request.recipe)
    data_path = launch.request_data(inventory, request)
    synthetic = "--synthetic" in request.extra_args
    own_copies = not synthetic and launch.on_each_node(inventory, data_path)
    if not synthetic:
        _check_data(connection, request.recipe, data_path, dataset, own_copies)
    if own_copies:
        _check_copies(connection, inventory, plan.nodes, data_path, dataset)
    spec = launch.train_spec(
        inventory, request, plan.interface, plan.code_dir, dict(os.environ), plan.nodes, plan.budget
    )
    # The claim and the start are one step on the head node (cluster_node.programs.start): two launches at once
    # give one run and one refusal. The payload travels as a file in the head's /tmp, not on /data.
    payload = f"/tmp/gpu-cluster-start.{uuid.uuid4().hex}.json"
    # A restart leaves out a node without its copy.
    probe = health.probe_command(inventory, plan.code_dir, data_path if own_copies else None)
    if own_copies and "--copy" not in remote.sh(connection, f"{probe} --help", check=False):
        raise remote.RemoteError(
            f"the nodes' cluster_node ({plan.code_dir}) predates `fab train --data` (its probe cannot check a "
            "restart's nodes for their copy): `fab sync` first"
        )
    remote.write_file(connection, payload, json.dumps({"spec": spec.to_json(), "probe": probe}))
    out = remote.sh(
        connection, nodecmd.node_command(inventory, "programs.start", payload, code_dir=plan.code_dir), check=False
    )
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise remote.RemoteError(f"the launch on {inventory.head.name} answered {out.strip()[-300:]!r}") from None
    if "run" not in result:
        raise remote.RemoteError(result.get("refused") or result.get("error") or str(result))
    return result["run"], int(result["log_offset"])


def _check_data(connection: Connection, recipe: str, data_path: str, dataset: str, own_copies: bool = False) -> None:
    """A prepared data set (meta.json or an image folder's train/) that the recipe can read: one line
    before the launch (was: "started", then a failure on every rank). `own_copies`: each node's (--data)."""
    folder = f"test -d {q(data_path + '/train')} && echo folder || echo none"
    out = remote.sh(connection, f"{folder}; cat {q(data_path + '/meta.json')} 2>/dev/null || true")
    first, _, text = out.partition("\n")
    try:
        meta = json.loads(text) if text.strip() else None
    except ValueError:
        meta = None
    if meta is None and first.strip() != "folder":
        how = _restage(data_path, dataset) if own_copies else catalog.missing_data(dataset)
        raise remote.RemoteError(f"no prepared data set at {data_path}: {how}")
    mismatch = catalog.input_mismatch(recipe, PurePosixPath(data_path).name, meta, first.strip() == "folder")
    if mismatch:
        raise remote.RemoteError(mismatch)


def _restage(data_path: str, dataset: str) -> str:
    """How each node's copy is made again (imagenet: the only data set prepare.py stages)."""
    if dataset != "imagenet":
        return "each node's own copy (a stop erases the instance store): copy it onto every node of the run again"
    return (
        "each node's own copy (a stop erases the instance store): stage it on every node with "
        f'`fab data --dataset imagenet --extra "--stage-to {data_path}" --all-nodes`'
    )


def _check_copies(connection: Connection, inventory: Inventory, nodes, data_path: str, dataset: str) -> None:
    """--data outside /data: each node of the run reads its own copy (a staged one), so every node must hold it,
    and where `fab data --stage-to` finished on one node, the same finished staging on all (one ImageFolder each:
    ranks reading different files would train on different samples and classes, silently)."""
    unfinished, marker = q(f"{data_path}/{STAGING_MARKER}"), q(f"{data_path}/{STAGED_MARKER}")
    there = f"test -d {q(data_path + '/train')} -o -f {q(data_path + '/meta.json')}"
    look = f"if test -e {unfinished}; then echo unfinished; else cat {marker} 2>/dev/null || "
    look += f"{{ {there} && echo present || echo missing; }}; fi"
    found = {}
    for node in nodes:
        via = look if node.rank == inventory.head.rank else _on_node(inventory, node, look)
        found[node.name] = remote.sh(connection, via, check=False).strip() or "unreachable"
    for state in ("unreachable", "missing", "unfinished"):
        named = [name for name, said in found.items() if said == state]
        if named and state == "unreachable":
            raise remote.RemoteError(f"{data_path} could not be looked for on {', '.join(named)}: `fab check` first")
        if named:
            where = "is missing" if state == "missing" else "holds a staging cut off"
            raise remote.RemoteError(f"{data_path} {where} on {', '.join(named)}: {_restage(data_path, dataset)}")
    stagings = set(found.values())
    if len(stagings) > 1 and any(said != "present" for said in stagings):
        unmarked = [name for name, said in found.items() if said == "present"]
        what = f"no finished staging on {', '.join(unmarked)}" if unmarked else "different stagings"
        raise remote.RemoteError(f"the nodes' copies at {data_path} differ ({what}): {_restage(data_path, dataset)}")


def _on_node(inventory: Inventory, node, command: str, timeout: int = 20) -> str:
    """`command` on another node, from the head over the cluster's own SSH (as the ranks are reached)."""
    return f"timeout {timeout} ssh -F {q(inventory.cluster_ssh_config)} {q(node.private_ip)} {q(command)}"


def follow_log(
    connection: Connection,
    inventory: Inventory,
    run_dir: str,
    out=sys.stdout,
    poll: float = 1.0,
    timeout: Optional[float] = None,
    follow: bool = True,
    offset: int = 0,
    on_progress: Optional[Callable[[Optional[Progress]], None]] = None,
    on_status: Optional[Callable[[Optional[RunStatus]], None]] = None,
    quiet_s: float = 10.0,
) -> Optional[RunStatus]:
    """Print train.log from byte `offset` as it grows until the run is no longer running;
    return the run status (None: none written). on_progress(progress.json) is called on each poll while following,
    on_status(run-status.json) on each read of it (a caller keeps it if a later read fails). Following,
    `quiet_s` without a log line prints where the run is (a long step, eval or start-up is not a hang)."""
    deadline = (time.monotonic() + timeout) if timeout else None
    heard = time.monotonic()
    log = f"{run_dir}/{rundir.TRAIN_LOG}"
    # Following: Open MPI's and the ranks' error output stays in the log, out of the stream.
    shown = logfilter.FollowFilter(f"`fab logs --run {run_dir.rstrip('/').rsplit('/', 1)[-1]}`") if follow else None
    while True:
        files = noderecords.read(connection, inventory, run_dir, *_FOLLOWED[bool(on_progress and follow)], strict=True)
        status = files.status
        if on_status:
            on_status(status)
        if on_progress and follow:
            on_progress(files.progress)
        chunk = remote.sh(connection, f"tail -c +{offset + 1} {q(log)} 2>/dev/null || true")
        if chunk:
            out.write(shown.feed(chunk) if shown else chunk)
            out.flush()
            offset += len(chunk.encode())
            heard = time.monotonic()
        elif follow and time.monotonic() - heard >= quiet_s:
            _refuse_orphaned(connection, inventory, run_dir)
            out.write(_quiet_line(connection, inventory, run_dir, time.monotonic() - heard))
            out.flush()
            heard = time.monotonic()
        if not follow or not files.running:
            out.write(shown.flush() if shown else "")
            return status
        if deadline and time.monotonic() > deadline:
            raise remote.RemoteError(f"the run in {run_dir} is still going after {timeout:.0f} s")
        time.sleep(poll)


# What each poll of follow_log reads: the status, and progress.json when someone wants it.
_FOLLOWED = {False: (rundir.RUN_STATUS,), True: (rundir.RUN_STATUS, rundir.PROGRESS)}


def follow_to_end(
    connection: Connection,
    inventory: Inventory,
    run_dir: str,
    offset: int = 0,
    on_progress: Optional[Callable[[Optional[Progress]], None]] = None,
    on_status: Optional[Callable[[Optional[RunStatus]], None]] = None,
    on_state: Optional[Callable[[noderecords.RunFiles], None]] = None,
) -> tuple[noderecords.RunFiles, Optional[RunStatus]]:
    """follow_log to the run's end, then the run's state and what --then-stop did: (state, final status).
    `on_state` has the state as soon as it is read (a connection the stopping head cuts later keeps it)."""
    status = follow_log(connection, inventory, run_dir, offset=offset, on_progress=on_progress, on_status=on_status)
    state = run_state(connection, inventory, run_dir)
    if on_state:
        on_state(state)
    return state, then_stop_outcome(connection, inventory, run_dir, state.status or status)


def _supervisor_state(run_dir: str) -> str:
    """Shell printing alive, dead or unknown (no pid file) for the run's supervisor on the head node: alive only as
    the supervisor (cluster_node.programs.runs.alive), since a new container numbers its processes from 1 again."""
    pid_file = q(f"{run_dir}/{rundir.LAUNCHER_PID}")
    alive = f'kill -0 "$p" 2>/dev/null && tr "\\0" "\\n" < /proc/"$p"/cmdline | grep -qxF {q(SUPERVISOR_MODULE)}'
    return f"p=$(cat {pid_file} 2>/dev/null) && {{ {alive} && echo alive || echo dead; }} || echo unknown"


def _refuse_orphaned(connection: Connection, inventory: Inventory, run_dir: str) -> None:
    """A run that says `running` whose supervisor is gone (its head node lost without a notice and back, the
    process killed) writes nothing more: a follower would wait forever. Its status is read again after the pid,
    since a supervisor that just ended wrote its final status first. No pid file: not known, go on."""
    if remote.sh(connection, _supervisor_state(run_dir), check=False).strip() != "dead":
        return
    status = noderecords.read(connection, inventory, run_dir, rundir.RUN_STATUS).status
    if status is not None and status.state == RunState.RUNNING:
        raise remote.RemoteError(
            f"the supervisor of {run_dir} on the head node is gone without a final status (its node restarted, or "
            f"it was killed): {terminal.resume_hint(run_dir)}"
        )


def _quiet_line(connection: Connection, inventory: Inventory, run_dir: str, quiet: float) -> str:
    """Where a run is that has logged nothing for a while, from progress.json (refreshed every few seconds)."""
    progress = noderecords.read(connection, inventory, run_dir, rundir.PROGRESS).progress
    if progress is None:
        return f"  ... no step yet ({quiet:.0f} s without a log line: starting up)\n"
    total = "?" if progress.max_steps is None else progress.max_steps
    return f"  ... at step {progress.step}/{total} ({quiet:.0f} s without a log line)\n"


def then_stop_outcome(
    connection: Connection,
    inventory: Inventory,
    run_dir: str,
    status: Optional[RunStatus],
    wait: float = 330.0,
    poll: float = 1.0,
    read_s: float = 30.0,
) -> Optional[RunStatus]:
    """The final status once --then-stop has answered (then_stop `sent` or `failed`): the supervisor
    gives its stop request up to 300 s (nodes.Nodes.then_stop). Still `stopping` after `wait`: as it is.
    A `stopping` older than `wait` by the node's clock is `requested`: its head went down before it could
    write the outcome and was started again since (a follow re-attached after `fab start`), nothing to
    wait for. A read that hangs `read_s` (a silent path to a node going down) ends the wait."""
    if status is None or status.then_stop != "stopping":
        return status
    try:
        if _age_s(connection, status.time, read_s) > wait:
            return dataclasses.replace(status, then_stop="requested")
        deadline = time.monotonic() + wait
        while status.then_stop == "stopping" and time.monotonic() < deadline:
            time.sleep(poll)
            status = (
                noderecords.read(connection, inventory, run_dir, rundir.RUN_STATUS, timeout=read_s).status or status
            )
    except CommandTimedOut:
        pass
    return status


def _age_s(connection: Connection, iso: str, read_s: float) -> float:
    """How long ago `iso` (a run file's UTC time) was by the node's clock; 0 if it does not parse."""
    try:
        then = datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return 0.0
    return float(remote.sh(connection, "date +%s", timeout=read_s).strip()) - then


def request_stop(
    connection: Connection,
    inventory: Inventory,
    run_dir: str,
    wait: float = 120.0,
    say: Callable[[str], None] = print,
    every: float = 10.0,
) -> RunStatus:
    """Graceful stop: the trainer checkpoints at the next step, then exits. Every `every` seconds of the
    wait, what it waits for (an eval already under way finishes first)."""
    # A line of its own, appended: a Spot watcher's `now: spot: ...` already there must not pass for this stop.
    remote.sh(connection, f"printf 'fab stop\\n' >> {q(f'{run_dir}/{rundir.STOP}')}")
    started = time.monotonic()
    told = started
    while time.monotonic() < started + wait:
        status = noderecords.read(connection, inventory, run_dir, rundir.RUN_STATUS).status
        if status is not None and status.state != RunState.RUNNING:
            return status
        if time.monotonic() - told >= every:
            told = time.monotonic()
            say(f"stop: still waiting ({told - started:.0f} s): {_stop_wait(connection, inventory, run_dir)}")
        time.sleep(1.0)
    raise remote.RemoteError(
        f"the run did not stop within {wait:.0f} s; it may be stuck in eval. "
        "Wait, or end it hard with `fab stop --force`"
    )


def _stop_wait(connection: Connection, inventory: Inventory, run_dir: str) -> str:
    """What a stop waits for, from rank 0's heartbeat (its last finished step) and the run's eval cadence."""
    config = noderecords.read(connection, inventory, run_dir, rundir.CONFIG).config
    beat = remote.sh(connection, f"cat {q(str(rundir.rank_beat(Path(run_dir), 0)))} 2>/dev/null || true").split()
    if not beat or not beat[0].isdigit():
        return "the run has not finished a step yet (start-up); the stop comes at its first"
    step, every = int(beat[0]), config.get("eval_every") or 0
    if every and step % every == 0 or step == config.get("max_steps"):
        return f"rank 0 is in the eval after step {step}: the stop comes after it (`fab stop --force` ends it now)"
    return f"rank 0 finished step {step}; the checkpoint comes after its next step"


def force_stop(connection: Connection, inventory: Inventory, run_dir: str) -> None:
    """Kill mpirun and the ranks; the supervisor survives to record the end (reason: FORCED), and
    launches no further attempt."""
    remote.sh(connection, f"touch {q(f'{run_dir}/{rundir.FORCED}')}")
    remote.sh(connection, f'kill -TERM "$(cat {q(f"{run_dir}/{rundir.MPIRUN_PID}")} 2>/dev/null)" 2>/dev/null || true')
    for node in inventory.nodes:
        remote.sh(
            connection,
            # [-]: the pattern must not match the remote shell that runs pkill
            _on_node(inventory, node, "pkill -KILL -f -- " + q("[-]-run-dir " + run_dir), timeout=15) + " || true",
            check=False,
        )


def fetch_run(
    connection: Connection, inventory: Inventory, run_dir: str, dest: Path
) -> tuple[list[Path], Optional[Path]]:
    """Best (else newest) checkpoint, config, vocabulary, summary, log, `fab report`'s report.md and
    PNGs, and the last eval texts into
    a fresh dest: an earlier copy is moved to DEST.previous, never merged with. Marks the run as
    fetched on the cluster. Returns the files and where the earlier copy went, if there was one."""
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with busy_while(connection, inventory, f"fab fetch {PurePosixPath(run_dir).name}"):
        fetched = _download_run(connection, inventory, run_dir, staging)
    previous = None
    if dest.exists():
        previous = dest.with_name(dest.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        dest.rename(previous)
    staging.rename(dest)
    remote.sh(connection, f"touch {q(f'{run_dir}/{rundir.FETCHED}')}")
    return [dest / p.relative_to(staging) for p in fetched], previous


@contextlib.contextmanager
def busy_while(connection: Connection, inventory: Inventory, what: str, every: float = 60.0) -> Iterator[None]:
    """A busy marker on /data (rundir.BusyMarker, as prepare.py's) kept fresh while the body runs: fab's own SSH
    traffic is not use to the idle watchdog, and a download longer than the idle time left was cut off by its stop.
    A laptop gone mid-way leaves a marker that goes stale (busy_signals.MARKER_FRESH_S), so it stops counting."""
    folder = f"{inventory.data_dir}/{clusterdir.CLUSTER}/{clusterdir.BUSY_DIR}"
    marker = q(f"{folder}/fab-{uuid.uuid4().hex[:12]}.json")
    body = q(json.dumps({"what": what, "time": time.time()}))
    remote.sh(connection, f"mkdir -p {q(folder)} && printf '%s\\n' {body} > {marker}", check=False)
    done = threading.Event()

    def refresh() -> None:
        while not done.wait(every):
            remote.sh(connection, f"touch {marker}", check=False)

    keeper = threading.Thread(target=refresh, daemon=True)
    keeper.start()
    try:
        yield
    finally:
        done.set()
        keeper.join(timeout=10)
        remote.sh(connection, f"rm -f {marker}", check=False)


def _download_run(connection: Connection, inventory: Inventory, run_dir: str, dest: Path) -> list[Path]:
    wanted = list(rundir.FETCHED_FILES)
    checkpoints = f"{q(run_dir)}/{rundir.CHECKPOINTS}"
    newest = f"ls -1 {checkpoints}/{rundir.CHECKPOINT_GLOB} 2>/dev/null | sort | tail -n 1"
    # A live run: its newest checkpoint (best.pt is an earlier eval's); an ended one: the best.
    found = noderecords.read(connection, inventory, run_dir, rundir.RUN_STATUS, rundir.CONFIG)
    config = found.config
    pick = newest if found.running else f"ls -1 {checkpoints}/{rundir.BEST_CHECKPOINT} 2>/dev/null || {newest}"
    chosen = remote.sh(connection, f"{pick} || true").strip()
    if chosen:
        wanted.append(chosen[len(run_dir) + 1 :])
    last_eval = remote.sh(
        connection, f"ls -1 {q(run_dir)}/{rundir.EVAL}/ 2>/dev/null | sort | tail -n 3 || true"
    ).split()
    wanted += [f"{rundir.EVAL}/{name}" for name in last_eval]
    fetched = []
    sftp = connection.sftp()
    for rel in wanted:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            sftp.get(f"{run_dir}/{rel}", str(target))
            fetched.append(target)
        except FileNotFoundError:
            target.unlink(missing_ok=True)  # sftp.get creates the local file before it finds none
    if config.get("data"):  # a text data set's vocabulary (an image data set has none)
        try:
            sftp.get(f"{config['data']}/spm.model", str(dest / "spm.model"))
            fetched.append(dest / "spm.model")
        except FileNotFoundError:
            (dest / "spm.model").unlink(missing_ok=True)  # sftp.get creates the local file first: 0 bytes
    return fetched
