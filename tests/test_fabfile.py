"""The fab tasks as a whole (issue 20 item 4): one error boundary for every task, no task module
importing another, `fab train` planning its launch once. Driven through
Fabric's own program (the `fab` CLI's parser and executor), in this process: no cluster, no network."""

from __future__ import annotations

import ast
import json
import re
import socket
from types import SimpleNamespace

import pytest
from conftest import REPO, one_node_inventory
from invoke.exceptions import Exit

import fabfile
from clusterops.inventory import Inventory
from clusterops.nodes import health, remote
from clusterops.nodes import probe as nodeprobe
from clusterops.nodes import view as nodeview
from clusterops.run import launch

TASKS = sorted(fabfile.ns.task_names)
TASK_MODULES = sorted(p for p in (REPO / "fabfile").glob("*.py") if p.name not in ("__init__.py", "common.py"))


def fab(*argv: str) -> int:
    """`fab ARGV` through Fabric's program: its exit code (0 when it returned)."""
    from fabric.main import make_program

    try:
        make_program().run(["fab", *argv])
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again on return: a connection there is refused


@pytest.fixture
def unreachable(tmp_path, monkeypatch):
    """An inventory whose one node refuses SSH (a node that is down, an sshd that died)."""
    (tmp_path / "known_hosts").write_text("")
    inventory = one_node_inventory(tmp_path, "gone", closed_port(), "key")
    monkeypatch.setenv("GPU_CLUSTER_INVENTORY", str(inventory))
    monkeypatch.chdir(REPO)
    return tmp_path


# status reports an unreachable node in its table (exit 0); ssh hands over to the ssh client; the rest
# never open a connection to a node.
NOT_ON_NODES = {"status", "ssh", "preflight", "cost", "audit", "release-spot", "inventory", "start", "stop-cluster"}


@pytest.mark.parametrize("task", [t for t in TASKS if t not in NOT_ON_NODES and not t.startswith("local.")])
def test_a_node_that_refuses_ssh_is_one_line_and_exit_1_for_every_task(task, unreachable, capsys):
    code = fab(task)
    err = capsys.readouterr().err
    assert code == 1, err
    errors = [line for line in err.strip().splitlines() if not line.startswith(f"{task}: ")]  # progress lines
    assert len(errors) == 1 and errors[0].startswith("error: "), err


@pytest.mark.parametrize("task", TASKS)
def test_every_task_has_the_error_boundary(task):
    from fabfile import common

    assert common.has_error_boundary(fabfile.ns[task]), f"{task} is not behind common.error_boundary"


@pytest.mark.parametrize("task", TASKS)
def test_every_tasks_summary_in_fab_list_is_a_whole_sentence(task):
    """`fab --list` shows a docstring's first line only (invoke.util.helpline): it must be a whole
    sentence, not the first 100 characters of a wrapped paragraph (issue 23 §13)."""
    from invoke.util import helpline

    line = helpline(fabfile.ns[task].body)
    assert line and line.endswith(".") and len(line) <= 80, f"{task}: {line!r}"


@pytest.mark.parametrize(
    "error",
    [
        "InventoryError",
        "LaunchError",
        "RemoteError",
        "LocalClusterError",
        "NoValidConnectionsError",
        "SSHException",
    ],
)
def test_the_boundary_turns_each_known_error_into_one_line(error):
    from paramiko.ssh_exception import NoValidConnectionsError, SSHException

    from clusterops.inventory import InventoryError
    from clusterops.local.cluster import LocalClusterError
    from fabfile.common import error_boundary

    errors = {
        "InventoryError": InventoryError("the inventory is broken"),
        "LaunchError": launch.LaunchError("the launch is broken"),
        "RemoteError": remote.RemoteError("the node said no"),
        "LocalClusterError": LocalClusterError("the local cluster is broken"),
        "NoValidConnectionsError": NoValidConnectionsError({("127.0.0.1", 1): ConnectionRefusedError()}),
        "SSHException": SSHException("Server '[127.0.0.1]:4444' not found in known_hosts"),
    }

    def body(c):
        raise errors[error]

    with pytest.raises(Exit) as raised:
        error_boundary(body)(None)
    assert raised.value.code == 1 and raised.value.message.startswith("error: ")
    assert len(raised.value.message.splitlines()) == 1


def test_the_boundary_leaves_a_bug_a_traceback():
    from fabfile.common import error_boundary

    def body(c):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        error_boundary(body)(None)


@pytest.mark.parametrize("module", TASK_MODULES, ids=lambda p: p.name)
def test_no_task_module_imports_another(module):
    """Shared helpers live in fabfile/common.py or clusterops, never in a task module."""
    for node in ast.walk(ast.parse(module.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level > 0:  # from .x import ..., from . import x
            names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
        elif (node.module or "").startswith("fabfile"):
            parts = node.module.split(".")
            names = parts[1:2] if len(parts) > 1 else [a.name for a in node.names]
        else:
            continue
        assert names == ["common"], f"{module.name}:{node.lineno} imports fabfile {names}"


class FakeConnection:
    """Just enough of a Fabric connection for `fab train` on a prepared cluster; counts its openings."""

    opened = 0
    runs = ""  # what `ls` of /data/runs answers

    def __init__(self, ip: str):
        FakeConnection.opened += 1
        self.ip, self.host, self.is_connected = ip, ip, True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, command: str, **kwargs):
        out = ""
        if command.startswith("ip -o -4 addr show"):
            out = f"2: eth0    inet {self.ip}/24 brd 10.0.0.255 scope global eth0\n"
        elif "meta.json" in command:
            out = 'none\n{"vocab_size": 600}'
        elif command.startswith("ls -1 ") and "/runs 2>/dev/null" in command:
            out = FakeConnection.runs
        elif command.startswith("stat -c"):
            out = "0\n"
        elif "cluster_node.programs.runs files" in command:  # a run's files: none yet (a new run)
            out = json.dumps({"run": command.split("--run ")[1].split()[0], "files": {}, "torn": {}})
        elif "cluster_node.programs.start" in command:  # the claim and start on the head node
            out = json.dumps({"run": "/data/runs/transformer-tiny", "log_offset": 0})
        return SimpleNamespace(stdout=out, stderr="", exited=0)


def test_fab_train_selects_and_checks_the_nodes_once(unreachable, monkeypatch, capsys):
    counts = {"select": 0, "quick": 0, "interface": 0}
    select, detect = Inventory.select, nodeview.detect_interface

    def counted_select(self, *args, **kwargs):
        counts["select"] += 1
        return select(self, *args, **kwargs)

    def counted_interface(conn, node):
        counts["interface"] += 1
        return detect(conn, node)

    def quick(inv, nodes):
        counts["quick"] += 1
        return [health.NodeHealth(node=n.name, verdict="ok", reasons=[], notes=[], details={}) for n in nodes]

    FakeConnection.opened = 0
    monkeypatch.setattr(Inventory, "select", counted_select)
    monkeypatch.setattr(nodeview, "detect_interface", counted_interface)
    monkeypatch.setattr(nodeprobe, "quick", quick)
    monkeypatch.setattr(remote, "connect", lambda inv, node: FakeConnection(node.private_ip))
    monkeypatch.setattr(remote, "write_file", lambda conn, path, text, mode=0o644: None)
    assert fab("train", "--steps", "3") == 0, capsys.readouterr().err
    assert counts == {"select": 1, "quick": 1, "interface": 1}
    assert FakeConnection.opened == 1  # one connection to the head node for the whole launch
    assert "started transformer-tiny, a new run: recipe transformer-tiny, data set numbers," in capsys.readouterr().out


def test_a_new_run_named_close_to_an_existing_one_says_which_it_did_not_resume(unreachable, monkeypatch, capsys):
    """Issue 32 §3: a typo in --run started a new run on the default data set without a word."""
    ok = [health.NodeHealth(node="node0", verdict="ok", reasons=[], notes=[], details={})]
    monkeypatch.setattr(nodeprobe, "quick", lambda inv, nodes: ok[: len(nodes)] * len(nodes))
    monkeypatch.setattr(remote, "connect", lambda inv, node: FakeConnection(node.private_ip))
    monkeypatch.setattr(remote, "write_file", lambda conn, path, text, mode=0o644: None)
    monkeypatch.setattr(FakeConnection, "runs", "ding-run\nother\n")
    assert fab("train", "--run", "ding-rnu", "--steps", "3") == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "started ding-rnu, a new run: recipe transformer-tiny, data set numbers," in out
    assert "note: ding-rnu is a new run; ding-run exists: `fab train --run ding-run` resumes that one" in out


def test_the_launch_plan_carries_what_the_launch_needs():
    fields = set(launch.LaunchPlan.__dataclass_fields__)
    assert {"request", "nodes", "interface", "code_dir", "verdicts"} <= fields


@pytest.mark.parametrize(
    "argv, task, run",
    [
        (["report", "r1"], "report", "r1"),
        (["report"], "report", ""),
        (["report", "--run", "r2"], "report", "r2"),
        (["logs", "r3", "--follow"], "logs", "r3"),
        (["logs", "--follow"], "logs", ""),
        (["fetch", "r4", "--dest", "out"], "fetch", "r4"),
        (["stop", "r5"], "stop", "r5"),
        (["train", "r6", "--steps", "10"], "train", "r6"),
    ],
)
def test_a_run_name_is_taken_by_position_or_by_flag_and_may_be_left_out(argv, task, run):
    """Invoke's positional arguments are all required (pyinvoke/invoke#159): `fab report` must still
    mean the latest run while `fab report RUN` names one."""
    from fabric.main import make_program
    from invoke.parser import Parser

    import fabfile

    contexts = fabfile.ns.to_contexts() if hasattr(fabfile, "ns") else make_program().collection.to_contexts()
    parsed = Parser(contexts=contexts).parse_argv(argv)
    assert parsed[0].name == task
    assert parsed[0].args["run"].value == run


def test_sync_refuses_a_directory_that_is_not_the_training_package(tmp_path, unreachable, capsys):
    """The ranks run `python -m train.train` from /data/code: a script-style directory (train.py, no
    __init__.py) would fail on every rank, so sync refuses it in one line before connecting."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "train.py").write_text("")
    assert fab("sync", "--source", str(tmp_path / "mine")) == 1
    assert "is not the training package: no __init__.py" in capsys.readouterr().err


def test_a_misspelt_option_is_named_with_the_closest_one(capsys):
    """Issue 32 §11: `fab train --recipie transformer-tiny` said Invoke's "No idea what 'transformer-tiny' is!"
    (the misspelt option was taken as the run name by position)."""
    for argv in (["train", "--recipie", "transformer-tiny"], ["train", "--recipie"]):
        assert fab(*argv) == 1
        err = capsys.readouterr().err
        assert err.strip() == "error: fab train has no option --recipie: did you mean --recipe? (`fab --help train`)"


def test_status_says_in_words_that_a_node_does_not_answer_ssh(unreachable, capsys):
    """Issue 32 §11: `fab status` printed paramiko's raw "NoValidConnectionsError: [Errno None] ..."."""
    assert fab("status") == 0
    out = capsys.readouterr().out
    assert "NoValidConnectionsError" not in out and "Errno None" not in out
    assert "no SSH on 127.0.0.1:" in out and "the node, its container or its sshd is down" in out, out


@pytest.mark.parametrize("args", [["--help", "train"], ["--list"]])
def test_a_reader_that_goes_away_gets_no_traceback(args):
    """`fab --help train | head -1`, `fab runs | head -1`: a closed pipe printed BrokenPipeError's traceback."""
    import os
    import subprocess

    from conftest import REPO, tool_env

    read, write = os.pipe()
    os.close(read)  # the reader is gone before fab writes
    done = subprocess.run(["fab", *args], cwd=REPO, env=tool_env(), stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr[-2000:]


def listed_tasks() -> list[str]:
    """The task names `fab --list` prints (what a user can type)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert fab("--list") == 0
    return re.findall(r"^  (\S+)", out.getvalue(), flags=re.MULTILINE)  # a wrapped line starts further in


def test_fab_list_lists_every_task():
    assert sorted(listed_tasks()) == TASKS


@pytest.mark.parametrize("task", listed_tasks())
def test_fab_task_help_prints_the_tasks_help_for_every_task(task, capsys):
    """Issue 31 §6: `fab train --help`, `fab report -h` said "no option --help" or took `--help` as a run name
    (the optional positional run name's patch ate it). -h where no option of the task took it."""
    flags = next(context.flags for context in fabfile.ns.to_contexts() if context.name == task)
    for flag in ["--help"] + ([] if "-h" in flags else ["-h"]):
        assert fab(task, flag) == 0, capsys.readouterr().err
        out, err = capsys.readouterr()
        assert out.startswith(f"Usage: fab [--core-opts] {task} ") and "Docstring:" in out, (flag, out, err)
        assert not err, err


def clusterops_calls(module, task: str) -> set[str]:
    """The clusterops functions task `task` of `module` calls, in its body or through its module's helpers:
    `x.f(...)` for `from clusterops[.sub] import x` (x a module), `f(...)` for `from clusterops[.sub].x import f`.
    Classes (a request, an error), clusterops.terminal (formatting) and PLUMBING are not use cases."""
    tree = ast.parse(module.read_text())
    modules, functions = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "clusterops":
            package = REPO.joinpath(*node.module.split("."))
            for alias in node.names:
                if (package / f"{alias.name}.py").exists():
                    modules[alias.asname or alias.name] = alias.name
                else:
                    functions[alias.asname or alias.name] = f"{node.module.rsplit('.', 1)[1]}.{alias.name}"
    defs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    found: set[str] = set()
    seen: set[str] = set()
    todo = [defs[task]]
    while todo:
        function = todo.pop()
        if function.name in seen:
            continue
        seen.add(function.name)
        for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
            target = call.func
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                module_name = modules.get(target.value.id)
                if module_name and module_name != "terminal" and not target.attr[0].isupper():
                    found.add(f"{module_name}.{target.attr}")
            elif isinstance(target, ast.Name) and target.id in functions and not target.id[0].isupper():
                found.add(functions[target.id])
            elif isinstance(target, ast.Name) and target.id in defs:
                todo.append(defs[target.id])
    return found - PLUMBING


# A session, a client or a connection: what a task hands its use case, not a use case; and dollars as text.
PLUMBING = {"session.aws_session", "session.pricing_client", "remote.connect", "remote.on_all", "cost.usd"}
TASK_BODIES = [
    (module, node.name)
    for module in TASK_MODULES
    for node in ast.parse(module.read_text()).body
    if isinstance(node, ast.FunctionDef) and any("task" in ast.dump(d) for d in node.decorator_list)
]


@pytest.mark.parametrize("module, task", TASK_BODIES, ids=[f"{m.stem}.{t}" for m, t in TASK_BODIES])
def test_each_task_parses_flags_calls_its_use_case_and_prints(module, task):
    """Issue 31 §5: fab train held its launch, budget and prediction (29 clusterops calls through
    fabfile/runs.py's helpers). A task calls at most three library functions: its use case and, where it
    streams or follows, what it prints from."""
    calls = clusterops_calls(module, task)
    assert len(calls) <= 3, f"{module.name} {task} calls {len(calls)} clusterops functions: {sorted(calls)}"


def test_fab_plan_from_a_step_time_needs_no_node(unreachable, capsys):
    """`fab plan --step-s` plans from the step time alone: its use case (clusterops.run.planner) reads no run, so
    a cluster whose node does not answer still gets its table and the cheapest plan."""
    argv = ["plan", "--step-s", "0.5", "--steps", "3600", "--types", "g5.xlarge,g4dn.xlarge", "--deadline", "2"]
    assert fab(*argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith("from ") and "target: 3600 steps (given); fixed global batch across N" in out
    assert "g5.xlarge: 1 x A10G per node" in out and "cheapest within 2 h: " in out, out
    # no run to read: the trainer's defaults, snapshots every 60 s and checkpoints every 30 minutes
    assert "  a lost node (--max-restarts): at most 60 s of steps, $" in out and "(the snapshot interval)" in out
    assert fab("plan", "--step-s", "0.5", "--types", "x9.unknown") == 1
    assert capsys.readouterr().err.strip() == "error: unknown instance type 'x9.unknown'"


def test_fab_check_quick_prints_its_use_cases_verdicts(unreachable, monkeypatch, capsys):
    """`fab check` through its use case (clusterops.run.checkup) on recorded probe facts: the JSON and exit 0 when
    fit; the table, then one line naming the bad node and exit 1."""
    import time

    cpu = {"time": time.time(), "mounted": True, "writable": True, "free_gb": 500.0, "xids": [], "gpus": []}
    cpu.update(torch="2.6.0", cuda=None, nccl=None)

    def probed(inv, nodes):
        return {n.name: dict(cpu) for n in nodes}, {n.name: "eth0" for n in nodes}

    monkeypatch.setattr(nodeprobe, "probe_nodes", probed)
    assert fab("check", "--quick", "--json") == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert doc["fit_to_train"] is True and [n["verdict"] for n in doc["nodes"]] == ["ok"], doc
    cpu["writable"] = False
    assert fab("check", "--quick") == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["node", "verdict", "interface", "gpus", "transport", "reasons"], out
    assert err.strip().splitlines()[-1].startswith("error: not fit to train: node0 (/data is not writable"), err


def test_the_use_case_guard_sees_every_task_and_calls_through_helpers(tmp_path):
    named = {"local.up": "local_up", "local.down": "local_down"}
    assert sorted(task for _, task in TASK_BODIES) == sorted(named.get(t, t.replace("-", "_")) for t in TASKS)
    module = tmp_path / "tasks.py"
    module.write_text(
        "from clusterops import terminal\nfrom clusterops.run import lifecycle, resume\n"
        "from clusterops.run.budget import refusal\n"
        "@task\ndef train(c):\n    _launch(c)\n    print(terminal.table([], []))\n"
        "def _launch(c):\n    resume.saved(c)\n    lifecycle.start_training(c)\n    refusal(1)\n    _more(c)\n"
        "def _more(c):\n    lifecycle.follow_log(c)\n    raise resume.Refused()\n"
    )
    assert clusterops_calls(module, "train") == {
        "resume.saved",
        "lifecycle.start_training",
        "budget.refusal",
        "lifecycle.follow_log",
    }
