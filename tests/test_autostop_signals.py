"""Issue 19 §15: what the watchdog counts as use, each with real parts: the real launcher.sh starting a
run, a real sshd with a real terminal session and a real port-forwarding connection, nvidia-smi's
output (a stand-in prints what a GPU node prints).

Contracts:
  * the kernel sets a tty's access time when a program reads input from it, its modification time on
    output (drivers/tty/tty_io.c, tty_update_time, 8 s granularity); `w` shows now - atime as IDLE
    (procps w(1)). A terminal counts for 30 minutes after its last input;
  * tcp_info's tcpi_bytes_received counts the payload bytes a connection received (Linux commit
    bdd1f9edacb5, RFC 4898 tcpEStatsAppHCThruOctetsReceived); `ss -i` prints it as bytes_received.
    A connection counts for 30 minutes after a minute in which its client sent more than a
    keepalive's worth (measured here: an idle `ssh -N` sent 224 bytes in 3 minutes to sshd with
    ClientAliveInterval 10);
  * `fab train` names the run in runs/.active before it starts the launcher (clusterops/nodes/remote.py);
    the launcher ends an attempt with no step within START_SECONDS (clusterops/launcher.sh)."""

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO
from supervisor_fixture import supervisor_process, write_spec

from cluster_node.daemons.autostop import busy_signals
from cluster_node.daemons.autostop import watchdog as autostop
from cluster_node.daemons.autostop.watchdog import Observation, Sources, Watchdog
from cluster_node.protocol import spec
from clusterops.inventory import Inventory, Node, SshSettings
from clusterops.run import launch

MIN = 60.0
_PTY = re.compile(rb"^sshd(-session)?: root@pts/(\d+)")


def reasons(data_dir: Path, now: float, sources=None, memory=None) -> list[str]:
    return autostop.local_reasons(autostop.observe(data_dir, now, sources, memory), None)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- a run that is starting


def test_a_launched_run_is_busy_from_its_launch_until_its_first_step_within_the_start_limit(tmp_path):
    """The real supervisor, with the spec `fab train` writes; the command has no step for 4 s."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    inv = Inventory(
        cluster="c",
        source="aws",
        gpus_per_node=1,
        nodes=[Node(0, "node0", "198.51.100.1", "127.0.0.1")],
        ssh=SshSettings("root", 4444, "/k", "/kh"),
        python=sys.executable,
        code_dir=str(REPO / "assets" / "train"),
        data_dir=str(tmp_path),
    )
    written = launch.train_spec(inv, launch.TrainRequest(run="r1"), "lo", inv.code_dir, dict(os.environ))
    limits = {**written.limits.__dict__, "poll": 30.0, "cleanup": 0.0}
    program = ["bash", "-c", "sleep 4; echo 'run ended at step 0'"]
    spec.write(
        run, dataclasses.replace(write_spec(run, program, ["127.0.0.1"], **limits), active_file=written.active_file)
    )
    quiet = Sources(pts=tmp_path / "no-pts", ssh_port=free_port())
    (tmp_path / "runs" / ".active").write_text(f"{run}\n")  # what fab train writes first
    assert any("launched" in r for r in reasons(tmp_path, time.time(), quiet))  # before the launcher starts
    launcher = supervisor_process(run)
    try:
        wait_for((run / "run-status.json").exists)
        now = time.time()
        assert any("run r1 launched 0 min ago, no step yet" in r for r in reasons(tmp_path, now, quiet))
        # Bounded: past the launcher's own START_SECONDS (15 min) and a minute, it is no reason.
        assert written.limits.start == 900 and spec.read(run).limits.start == 900
        assert not any("launched" in r for r in reasons(tmp_path, now + 17 * MIN, quiet))
    finally:
        assert launcher.wait(timeout=60) == 0
    assert not (tmp_path / "runs" / ".active").exists()
    assert reasons(tmp_path, time.time(), quiet) == []  # the run is over: idle


# ---------------------------------------------------------------- GPUs


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    """nvidia-smi as on a 1-GPU node: writes to tmp/gpus (utilisation, MiB used, MiB total) and tmp/pids."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.write_text(
        f'#!/bin/sh\ncase "$1" in --query-compute-apps=*) cat {tmp_path}/pids ;; *) cat {tmp_path}/gpus ;; esac\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    (tmp_path / "pids").write_text("")

    def set_gpu(util: int, pids: str = "") -> None:
        (tmp_path / "gpus").write_text(f"{util}, 9000, 15360\n")
        (tmp_path / "pids").write_text(pids)

    return set_gpu


def write_run(data: Path, name: str, state: str, step_age_s: float, active: bool) -> None:
    run = data / "runs" / name
    run.mkdir(parents=True, exist_ok=True)
    (run / "progress.json").write_text('{"step": 40}')  # a crashed trainer never writes "ended"
    os.utime(run / "progress.json", (time.time() - step_age_s,) * 2)
    (run / "run-status.json").write_text(f'{{"state": "{state}"}}')
    if active:  # written at its launch, long before its last step
        (data / "runs" / ".active").write_text(f"{run}\n")
        os.utime(data / "runs" / ".active", (time.time() - 2 * 3600,) * 2)


@pytest.fixture
def booted(monkeypatch):
    """This node's boot time, so many seconds ago (a fresh CI machine's own is recent)."""

    def set_boot(seconds_ago: float) -> None:
        monkeypatch.setattr(busy_signals, "boot_time", lambda: time.time() - seconds_ago)

    set_boot(3 * 3600)
    return set_boot


def test_the_boot_time_is_the_kernels(tmp_path):
    # btime is the wall clock less CLOCK_BOOTTIME (suspended time included, unlike CLOCK_MONOTONIC)
    assert abs(busy_signals.boot_time() - (time.time() - time.clock_gettime(time.CLOCK_BOOTTIME))) < 120
    (tmp_path / "stat").write_text("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n")
    assert busy_signals.boot_time(tmp_path / "stat") == 1700000000.0
    assert busy_signals.boot_time(tmp_path / "none") is None


def test_gpu_work_after_a_failed_run_is_busy_and_a_hung_marked_run_is_not(tmp_path, gpus, booted):
    quiet = Sources(pts=tmp_path / "no-pts", ssh_port=free_port())
    write_run(tmp_path, "failed", "failed", 40 * MIN, active=False)
    gpus(87)  # someone's own work on the GPU after the run failed
    assert "GPU 87% busy" in reasons(tmp_path, time.time(), quiet)
    write_run(tmp_path, "hung", "running", 40 * MIN, active=True)
    gpus(100)  # a hung collective of a marked run: the launcher ends it, the GPU load is no reason
    assert reasons(tmp_path, time.time(), quiet) == []
    # The eighth read: the same marks after a stop and `fab start` (launched 2 h ago, booted 1 h ago): no
    # launcher or rank of that run is here, and GPU work started by hand is busy, not a hung run.
    booted(3600)
    assert reasons(tmp_path, time.time(), quiet) == ["GPU 100% busy"]


def test_a_gpu_process_counts_until_30_minutes_after_the_gpu_was_last_busy(tmp_path, gpus):
    quiet, memory, t0 = Sources(pts=tmp_path / "no-pts", ssh_port=free_port()), {}, time.time()
    gpus(0, "4242\n")  # a notebook kernel holding the GPU between cells
    assert "1 GPU process(es)" in reasons(tmp_path, t0, quiet, memory)[0]
    assert reasons(tmp_path, t0 + 29 * MIN, quiet, memory)
    assert reasons(tmp_path, t0 + 31 * MIN, quiet, memory) == []  # held, unused: no reason
    gpus(60, "4242\n")
    assert reasons(tmp_path, t0 + 32 * MIN, quiet, memory) == ["GPU 60% busy", "1 GPU process(es)"]


# ---------------------------------------------------------------- a real sshd: terminals and connections


@pytest.fixture
def sshd(tmp_path):
    """sshd on a free loopback port, key-only root login as the container's, with its keepalive."""
    binary = shutil.which("sshd") or "/usr/sbin/sshd"
    if not os.path.exists(binary) or os.geteuid() != 0:
        pytest.skip("needs sshd and root")
    keys = tmp_path / "sshd"
    keys.mkdir()
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    port = free_port()
    config = keys / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\nAuthorizedKeysFile {keys / 'client.pub'}\n"
        f"PidFile {keys / 'sshd.pid'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
        "StrictModes no\nAllowTcpForwarding yes\nClientAliveInterval 10\nClientAliveCountMax 3\n"
    )
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege-separation directory
    server = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stderr=subprocess.DEVNULL)
    wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0)
    client = ["ssh", "-i", str(keys / "client"), "-p", str(port), "-o", "StrictHostKeyChecking=no"]
    client += ["-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
    yield port, client
    server.terminate()
    server.wait()


def session_tty(client: subprocess.Popen) -> Path:
    """The pty sshd allocated for this session (its process reads "sshd: root@pts/N")."""
    found: list[Path] = []

    def look() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                match = _PTY.match(cmdline.read_bytes())
            except OSError:
                continue
            if match:
                found.append(Path("/dev/pts") / match.group(2).decode())
        return bool(found) or client.poll() is not None

    wait_for(look)
    assert found, "no terminal session"
    return found[-1]


def test_a_terminal_counts_while_it_had_input_in_the_last_30_minutes(sshd, tmp_path):
    _, ssh = sshd
    session = subprocess.Popen([*ssh, "-tt", "root@127.0.0.1", "cat > /dev/null"], stdin=subprocess.PIPE)
    try:
        tty = session_tty(session)
        name = f"pts/{tty.name}"
        now = time.time()
        assert any(name in r for r in reasons(tmp_path, now))  # just opened: in use
        old = now - 31 * MIN
        os.utime(tty, (old, old))  # as if the last key had been pressed 31 minutes ago
        idle = reasons(tmp_path, now)
        assert not any(name in r or "interactive SSH session" in r for r in idle), idle
        session.stdin.write(b"ls\n")
        session.stdin.flush()
        wait_for(lambda: tty.stat().st_atime > old + MIN)  # `cat` read it: the kernel set the atime
        assert any(name in r for r in reasons(tmp_path, time.time()))
    finally:
        session.kill()
        session.wait()


def test_an_ssh_connection_without_a_terminal_counts_while_it_carries_traffic(sshd, tmp_path):
    """A port forward (what VS Code Remote and a Jupyter tunnel are): no pty, only traffic."""
    port, ssh = sshd
    sink = socket.create_server(("127.0.0.1", 0))
    received = []

    def drain():  # every connection the tunnel forwards (the readiness probe's too)
        try:
            while True:
                conn, _ = sink.accept()
                while chunk := conn.recv(65536):
                    received.append(len(chunk))
        except OSError:  # the sink closed at the end of the test
            return

    threading.Thread(target=drain, daemon=True).start()
    forward = free_port()
    tunnel = subprocess.Popen([*ssh, "-N", "-L", f"{forward}:127.0.0.1:{sink.getsockname()[1]}", "root@127.0.0.1"])
    try:
        wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", forward)) == 0)
        sources, memory, t0 = Sources(pts=tmp_path / "no-pts", ssh_port=port), {}, time.time()
        assert any("SSH connection from 127.0.0.1" in r for r in reasons(tmp_path, t0, sources, memory))
        assert reasons(tmp_path, t0 + 31 * MIN, sources, memory) == []  # keepalives only for 31 min
        with socket.create_connection(("127.0.0.1", forward)) as conn:
            conn.sendall(b"x" * 65536)  # a notebook's output, a file sync
            wait_for(lambda: sum(received) >= 65536)
        assert any("SSH connection" in r for r in reasons(tmp_path, t0 + 32 * MIN, sources, memory))
        assert reasons(tmp_path, t0 + 63 * MIN, sources, memory) == []
    finally:
        tunnel.kill()
        tunnel.wait()
        sink.close()


# ---------------------------------------------------------------- fab's own connections, interactive use alone


def fab_connection(port: int, key: Path, marks: Path):
    """What clusterops.nodes.remote.connect opens (its class, its marking), to the test's sshd."""
    import paramiko

    from clusterops.nodes import remote

    connection = remote.MarkedConnection(
        host="127.0.0.1",
        user="root",
        port=port,
        connect_kwargs={"key_filename": str(key), "look_for_keys": False, "allow_agent": False},
    )
    connection.marks = str(marks)
    connection.client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    return connection


def test_fabs_own_connections_never_count_as_use_however_much_they_send(sshd, tmp_path):
    """Issue 28: a forgotten `fab monitor` sends ~9-18 KB a minute per node over SSH, above the
    4 KiB floor: it kept the cluster busy forever. Each fab command now leaves its connection's
    SSH_CONNECTION (sshd's own variable, the client as the server sees it) in the container's mark
    folder; the watchdog skips those connections. An ssh tunnel of the user's still counts."""
    from clusterops.nodes import remote

    port, ssh = sshd
    marks, unmarked = tmp_path / "fab-ssh", tmp_path / "no-marks"
    marks.mkdir()
    assert remote.MarkedConnection.marks == remote.FAB_SSH_MARKS  # the container's folder (contract.py)
    connection = fab_connection(port, tmp_path / "sshd" / "client", marks)
    try:
        connection.run("true", hide=True, in_stream=False)
        local = connection.client.get_transport().sock.getsockname()
        (mark,) = [p.name for p in marks.iterdir()]
        assert mark == f"127.0.0.1 {local[1]} 127.0.0.1 {port}"
        key = f"127.0.0.1:{local[1]}>127.0.0.1:{port}"
        before = autostop.signals.ssh_connections(port)[key]
        for _ in range(30):  # what `fab monitor` sends in a minute or two
            connection.run("true", hide=True, in_stream=False)
        sent = autostop.signals.ssh_connections(port)[key] - before
        print(f"fab: {sent / 30:.0f} client bytes per command")
        assert sent > autostop.signals.CONNECTION_FLOOR_BYTES  # over the floor: it counted as use
        t0 = time.time()
        sources, memory = Sources(pts=tmp_path / "no-pts", ssh_port=port, fab_marks=marks), {}
        assert not any("SSH connection" in r for r in reasons(tmp_path, t0, sources, memory))
        for _ in range(15):
            connection.run("true", hide=True, in_stream=False)
        assert not any("SSH connection" in r for r in reasons(tmp_path, t0 + MIN, sources, memory))
        memory = {}  # the same connection, no marks: it is use
        blind = Sources(pts=tmp_path / "no-pts", ssh_port=port, fab_marks=unmarked)
        assert any("SSH connection from 127.0.0.1" in r for r in reasons(tmp_path, t0, blind, memory))
    finally:
        connection.close()
    wait_for(lambda: key not in autostop.signals.ssh_connections(port))
    os.utime(marks / mark, (t0 - 11 * MIN, t0 - 11 * MIN))
    assert autostop.signals.fab_connections(marks, autostop.signals.ssh_connections(port), t0) == set()
    assert not (marks / mark).exists()  # the connection is gone: its old mark too


def test_interactive_use_alone_counts_three_hours_at_most():
    """Issue 28: a terminal with a key pressed now and then, or a tool polling through a tunnel, kept
    an idle cluster (no run, idle GPUs) up forever. Terminals and SSH connections, this node's or
    another's, alone count for watchdog.INTERACTIVE_MAX_S (3 h); then as idle, so the cluster stops
    idle_minutes later, unless work comes (training, GPU work, data preparation), which starts the
    count over."""
    dog = Watchdog(60, MIN)
    dog.starting = 0
    t0 = 1_000_000.0
    typing = Observation(t0, terminals=("terminal pts/3 (input 1 min ago)",))
    peer = ["node1: SSH connection from 10.0.0.9:51234 (traffic 0 min ago)"]
    for minute in range(0, 181):
        reasons_now, decision = dog.tick(dataclasses.replace(typing, time=t0 + minute * MIN), peer)
        assert reasons_now and not decision.stop, minute
    reasons_now, decision = dog.tick(dataclasses.replace(typing, time=t0 + 181 * MIN), peer)
    assert reasons_now == [] and not decision.stop  # the heartbeat says idle from here
    for minute in range(182, 241):
        assert dog.tick(dataclasses.replace(typing, time=t0 + minute * MIN), peer)[0] == []
    _, decision = dog.tick(dataclasses.replace(typing, time=t0 + 241 * MIN), peer)
    assert decision.stop and "idle for 60 min" in decision.reason
    # Work resets the count: a step advancing, then the terminal alone again counts 3 h anew.
    working = dataclasses.replace(typing, time=t0 + 242 * MIN, step=5, progress_age_s=10.0)
    assert any("training step" in r for r in dog.tick(working)[0])
    alone = dataclasses.replace(typing, time=t0 + 243 * MIN, step=None, progress_age_s=None)
    assert dog.tick(alone)[0] == list(typing.terminals)
