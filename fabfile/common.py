"""Helpers shared by the fab tasks: the task decorator (one error boundary), settings, inventory,
connections, prices, one-line errors."""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import os
import shlex
import signal
import socket
import sys
import threading
from pathlib import Path

import fabric
from invoke.exceptions import Exit
from paramiko.ssh_exception import NoValidConnectionsError, SSHException

from clusterops import terminal
from clusterops.aws import audit
from clusterops.aws.session import AwsConfigError, aws_session
from clusterops.inventory import (
    DEFAULT_INVENTORY,
    DEFAULT_OUTPUTS,
    Inventory,
    InventoryError,
)
from clusterops.local import cluster as localcluster
from clusterops.nodes import remote
from clusterops.predict import plan as planning
from clusterops.run import drill, launch, lifecycle

ERRORS = (
    InventoryError,
    launch.LaunchError,
    remote.RemoteError,
    localcluster.LocalClusterError,
    drill.DrillError,
    AwsConfigError,
    audit.AuditError,
    planning.PlanError,
)
# A node SSH cannot reach: refused or unanswered (paramiko's NoValidConnectionsError, the socket's
# timeout at connect_timeout), or a failed handshake, host key or login (SSHException).
SSH_ERRORS = (NoValidConnectionsError, socket.timeout, SSHException)


def fail(error: Exception) -> Exit:
    return Exit(f"error: {error}", code=1)


def error_boundary(function):
    """Every task's one error boundary: the errors the library raises on purpose, and a node SSH
    cannot reach, become one line `error: ...` and exit code 1; anything else stays a traceback."""

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except ERRORS as error:
            raise fail(error) from None
        except SSH_ERRORS as error:
            detail = remote.failure(error) if isinstance(error, (NoValidConnectionsError, socket.timeout)) else error
            raise Exit(
                f"error: SSH: {detail or type(error).__name__} (`fab status` shows which nodes answer)", code=1
            ) from None

    bounded.error_boundary = True  # type: ignore[attr-defined]
    return bounded


def has_error_boundary(task) -> bool:
    return bool(getattr(task.body, "error_boundary", False))


def _allow_optional_positionals() -> None:
    """`fab report RUN` as well as `fab report`: Invoke's positional arguments are all required
    (pyinvoke/invoke#159, open), so a missing optional one gets "" at the end of its task's arguments
    instead of Invoke's "did not receive required positional arguments". A bare word after such a task
    is taken as its run name, as Invoke takes any positional argument."""
    from invoke.parser.parser import ParseMachine

    complete = ParseMachine.complete_context
    if getattr(complete, "optional_positionals", False):
        return

    def complete_context(self) -> None:
        for argument in self.context.missing_positional_args if self.context else ():
            if argument.name in OPTIONAL_POSITIONALS:
                argument.set_value("", cast=False)
        complete(self)

    complete_context.optional_positionals = True  # type: ignore[attr-defined]
    ParseMachine.complete_context = complete_context  # type: ignore[method-assign]


OPTIONAL_POSITIONALS = ("kind", "run")  # a task may take these by position (`fab logs RUN`, `fab drill KIND`)
_allow_optional_positionals()


def _name_unknown_options() -> None:
    """A misspelt option (`fab train --recipie transformer-tiny`) was taken as the run name by position,
    and its value then gave Invoke's "No idea what 'transformer-tiny' is!": one line naming the option
    and the closest the task has. No positional value starts with a dash (run names and kinds do not)."""
    from invoke.exceptions import ParseError
    from invoke.parser.parser import ParseMachine

    see = ParseMachine.see_positional_arg
    if getattr(see, "named_options", False):
        return

    def see_positional_arg(self, value: str) -> None:
        if self.context and self.initial and value in self.initial.flags:
            return _core_flag(self, value)  # `fab report --help`: Invoke's own core-flag branch, not a run name
        if value.startswith("-") and value != "-" and self.context:
            flags = [flag for flag in self.context.flags if flag.startswith("--")]
            close = difflib.get_close_matches(value.split("=")[0], flags, n=1)
            hint = f": did you mean {close[0]}?" if close else ""
            name = self.context.name
            raise ParseError(f"error: fab {name} has no option {value}{hint} (`fab --help {name}`)", self.context)
        see(self, value)

    see_positional_arg.named_options = True  # type: ignore[attr-defined]
    ParseMachine.see_positional_arg = see_positional_arg  # type: ignore[method-assign]


def _core_flag(machine, token: str) -> None:
    """A core flag after a task that still waits for a positional argument: what Invoke's parser does with it
    after any other task (ParseMachine.handle, "Initial-context flag being given as per-task flag"): --help/-h
    takes the task's name as its value (the task's help), any other core flag reads on as a flag."""
    flag = machine.initial.flags[token]
    if flag.name == "help":
        flag.value = machine.context.name
    else:
        machine.switch_to_flag(token)


_name_unknown_options()


def task(*args, **kwargs):
    """fabric.task behind error_boundary: `@task` or `@task(help=...)`. A task with a `run` parameter
    takes the run name by position too (`fab report RUN`); "" means none was given."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return task()(args[0])

    def decorate(function):
        return fabric.task(*args, positional=_positionals(function), **kwargs)(error_boundary(function))

    return decorate


def _positionals(function) -> list[str]:
    return [name for name in OPTIONAL_POSITIONALS if name in inspect.signature(function).parameters]


@contextlib.contextmanager
def ctrl_c_ends(message: str, code: int = 130):
    """Within it, Ctrl-C prints `message` on stderr and ends the process at once, wherever it lands: a
    KeyboardInterrupt raised during an SSH round trip waits in Invoke's runner for the remote command's
    output to end (invoke/runners.py _finish joins its reader threads), forever for a read that hangs."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return

    def end(signum, frame) -> None:
        sys.stdout.flush()
        print(message, file=sys.stderr, flush=True)
        os._exit(code)  # the run goes on on the cluster; nothing here needs finishing

    previous = signal.signal(signal.SIGINT, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def progress(line: str) -> None:
    """A wait over a few seconds is announced before it starts (stderr: `--json` keeps stdout clean)."""
    print(line, file=sys.stderr, flush=True)


def number(value, flag: str, kind=float):
    """A task option as a number, or one line naming the option (`--steps abc`)."""
    if value is None or value == "":
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        what = "a whole number" if kind is int else "a number"
        raise Exit(f"error: invalid {flag} {value!r}: {what}", code=1) from None


def whole_number(value, flag: str):
    return number(value, flag, kind=int)


def given(**values) -> dict:
    """The options given (not None): the rest take the use case's own defaults, each written once."""
    return {name: value for name, value in values.items() if value is not None}


@contextlib.contextmanager
def aws_errors(what: str = "AWS"):
    """botocore's errors as one actionable line (the service's own message names the cause)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as error:
        raise Exit(f"error: {what}: {terminal.aws_error(error)}", code=1) from None
    except BotoCoreError as error:
        raise Exit(f"error: {what}: {error} (check AWS_PROFILE / `aws configure` / the network)", code=1) from None


# The tasks' defaults, in one place; fabric.yaml (or ~/.fabric.yaml) overrides them per user.
DEFAULTS = {
    "inventory": str(DEFAULT_INVENTORY),
    **{
        name: getattr(launch.TrainRequest, name) for name in ("recipe", "master_port", "stall_minutes", "start_minutes")
    },
}


def settings(c) -> dict:
    """fabric.yaml's gpu_cluster section over DEFAULTS."""
    return {**DEFAULTS, **dict(c.config.get("gpu_cluster") or {})}


def inventory_path(c) -> Path:
    return Path(os.environ.get("GPU_CLUSTER_INVENTORY") or settings(c)["inventory"])


def load_inventory(c) -> Inventory:
    path = inventory_path(c)
    if not path.exists() and DEFAULT_OUTPUTS.exists():
        raise fail(InventoryError(f"{DEFAULT_OUTPUTS} exists but no inventory: run `fab inventory`"))
    if (
        path.exists()
        and DEFAULT_OUTPUTS.exists()
        and DEFAULT_OUTPUTS.stat().st_mtime > path.stat().st_mtime
        and Inventory.load(path).source == "aws"
    ):
        raise fail(InventoryError("the inventory is older than the last deploy: run `fab inventory`"))
    try:
        inventory = Inventory.load(path)
    except InventoryError as error:
        raise fail(error) from None
    return _readdressed(inventory, path)


def _readdressed(inventory: Inventory, path: Path) -> Inventory:
    """An AWS node that does not answer may have been started again with a new public IP (Spot,
    console): its address from EC2, saved. Without EC2 access the inventory stays as it was."""
    from botocore.exceptions import BotoCoreError, ClientError

    from clusterops.nodes.readdress import readdress_unreachable

    if inventory.source != "aws" or inventory.ssh.proxy_command:
        return inventory
    try:
        fresh, lines = readdress_unreachable(inventory, aws_session(inventory.region).client("ec2"))
    except (BotoCoreError, ClientError) as error:
        print(f"warning: some node does not answer and EC2 could not be asked for its address: {error}")
        return inventory
    for line in lines:
        print(line)
    if fresh is not inventory:
        fresh.save(path)
    return fresh


def head(inv: Inventory):
    return remote.connect(inv, inv.head)


def run_dir(connection, inv: Inventory, run: str | None) -> str:
    """The named run's directory (which must exist), else the active or latest run's."""
    if run:
        path = launch.run_dir(inv, run)
        if remote.sh(connection, f"test -d {shlex.quote(path)} && echo yes || true").strip() != "yes":
            runs = remote.sh(connection, f"ls -1 {shlex.quote(inv.data_dir + '/runs')} 2>/dev/null || true").split()
            raise fail(remote.RemoteError(f"no run named {run!r} (runs: {', '.join(runs) or 'none'})"))
        return path
    latest = lifecycle.latest_run(connection, inv)
    if not latest:
        raise fail(remote.RemoteError("no runs yet: start one with `fab train`"))
    return latest


def cluster_config(**overrides):
    """cdk.json's context with the task's overrides, validated like `cdk synth` does."""
    import json

    from stacks.config import ClusterConfig, ConfigError

    context = json.loads(Path("cdk.json").read_text()).get("context", {})
    try:
        return ClusterConfig.from_context({**context, **{k: v for k, v in overrides.items() if v is not None}})
    except ConfigError as error:
        raise fail(error) from None


def training_code_dir(inv: Inventory) -> str:
    """lifecycle.code_dir_on, over a connection of its own."""
    with head(inv) as conn:
        return lifecycle.code_dir_on(conn, inv)
