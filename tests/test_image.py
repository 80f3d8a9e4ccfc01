"""The training image provides every command that the node-side scripts run inside the container:
the supervisor and the other node programs (cluster_node: the argv they run through tools.run and
subprocess), entrypoint.sh and the shell commands the fab tasks send. A command is either in the NGC
PyTorch base (Ubuntu's essential tools, python, its Open MPI), put there by the NVIDIA runtime, or
installed by assets/docker/Dockerfile."""

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from test_launch import inventory

from clusterops.run import launch

DOCKERFILE = REPO / "assets" / "docker" / "Dockerfile"
SCRIPTS = [REPO / "assets" / "docker" / "entrypoint.sh"]
SUPERVISOR = [REPO / "assets" / "cluster_node" / "supervisor" / n for n in ("nodes.py", "hang.py")]
BOOTSTRAP = REPO / "assets" / "bootstrap" / "node-bootstrap.sh"  # its `docker exec CONTAINER COMMAND`s
# Python files whose `sh(connection, "...")` commands run in the container (fab connects to it).
SENDERS = [*sorted((REPO / "clusterops").rglob("*.py")), *sorted((REPO / "fabfile").glob("*.py"))]
TRAIN_REQUIREMENTS = REPO / "assets" / "train" / "requirements.txt"

BASE = "NGC base"
RUNTIME = "NVIDIA container runtime (--gpus)"
OPTIONAL = "optional: run only where present, its absence is a finding (cluster_node.programs.probe)"
NODE_PACKAGE = REPO / "assets" / "cluster_node"  # its programs run commands through tools.run([...])
# Command -> where it comes from in the container: BASE, RUNTIME or the apt package that installs it.
PROVIDERS = {
    **dict.fromkeys(
        [
            "bash",
            "cat",
            "chmod",
            "cut",
            "date",
            "env",
            "head",
            "install",
            "ls",
            "mkdir",
            "mv",
            "nohup",
            "paste",
            "rm",
            "sleep",
            "sort",
            "stat",
            "tail",
            "tee",
            "timeout",
            "touch",
        ],
        BASE,
    ),
    **dict.fromkeys(["awk", "grep", "sed", "hostname", "mountpoint", "setsid"], BASE),  # essential packages
    **dict.fromkeys(["python", "python3", "pip", "mpirun"], BASE),  # the NGC PyTorch image itself
    "nvidia-smi": RUNTIME,
    "dmesg": BASE,  # util-linux, essential
    "df": BASE,  # coreutils, essential (fab drill fill-data reads the free space)
    "journalctl": OPTIONAL,  # the kernel log where dmesg is not allowed
    "dcgmi": OPTIONAL,  # DCGM's diagnostic, where a DCGM install provides it
    "ssh": "openssh-client",
    "sshd": "openssh-server",
    "ip": "iproute2",
    "ss": "iproute2",  # the watchdog's SSH connection signal (busy_signals)
    "pgrep": "procps",
    "pkill": "procps",
    "iperf3": "iperf3",
    "py-spy": "pip: py-spy",  # the launcher's hang stacks; needs the container's SYS_PTRACE
}
BUILTINS = {
    "[",
    "[[",
    ":",
    "true",
    "false",
    "echo",
    "printf",
    "read",
    "kill",
    "cd",
    "exit",
    "return",
    "exec",
    "source",
    ".",
    "declare",
    "local",
    "export",
    "set",
    "shopt",
    "trap",
    "wait",
    "break",
    "continue",
    "command",
    "compgen",
    "test",
    "eval",
    "shift",
    "unset",
    "type",
    "for",
    "case",
    "esac",
    "in",
    "fi",
    "done",
}
KEYWORDS = {"if", "then", "else", "elif", "while", "until", "do", "!", "time"}
WRAPPERS = {"timeout": 1, "setsid": 0, "nohup": 0, "exec": 0, "command": 0}  # word -> arguments to skip
SEPARATORS = ";|&\n(){}"


def _close(text: str, i: int) -> int:
    """Index just after the ')' that closes the '(' at text[i] (quotes respected)."""
    depth, quote = 0, ""
    while i < len(text):
        c = text[i]
        if quote:
            quote = "" if c == quote else quote
            i += 2 if c == "\\" and quote == '"' else 1
            continue
        quote = c if c in "'\"" else ""
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == ")" and depth == 0:
            return i + 1
        i += 1
    return i


def _segments(text: str, words: set) -> list[str]:
    """Simple commands outside quotes; $(...) and ((...)) are scanned into words and blanked."""
    segments, current, quote, i = [], "", "", 0
    while i < len(text):
        c = text[i]
        if quote != "'" and (text.startswith("$(", i) or (not quote and text.startswith("((", i))):
            end = _close(text, i + (c == "$"))
            inner = text[i + 2 : end - 1]
            if c == "$" and not inner.startswith("("):
                words |= command_words(inner)
            else:  # arithmetic: only its command substitutions run commands
                words |= {w for sub in re.findall(r"\$\(([^()]*)\)", inner) for w in command_words(sub)}
            current, i = current + ("$v" if c == "$" else " true "), end
        elif quote != "'" and text.startswith("${", i):
            end = text.index("}", i) + 1
            current, i = current + "$v", end
        elif c == "\\" and quote != "'":
            current, i = current + text[i : i + 2], i + 2
        elif quote or c in "'\"":
            quote = "" if c == quote else (quote or c)
            current, i = current + c, i + 1
        elif c in SEPARATORS and not (c == "&" and (text[i - 1 : i] in "<>" or text[i + 1 : i + 2] == ">")):
            segments.append(current)
            current, i = "", i + 1
        else:
            current, i = current + c, i + 1
    return segments + [current]


def _without_redirections(tokens: list[str]) -> list[str]:
    kept, target_next = [], False
    for token in tokens:
        if target_next or re.match(r"^[0-9]*[<>]", token):
            target_next = not target_next and bool(re.match(r"^[0-9]*[<>]+&?$", token))
            continue
        kept.append(token)
    return kept


def _command(tokens: list[str], words: set) -> list[str]:
    """The simple command's words from its command name on (no assignments, redirections or
    wrappers; wrappers that are programs, like timeout, go into words)."""
    tokens = _without_redirections(tokens)
    while tokens:
        head = tokens[0]
        if head in KEYWORDS or re.match(r"^[\w\[\]$]+\+?=", head):
            tokens = tokens[1:]
        elif head == "command" and tokens[1:2] == ["-v"]:
            return []  # only asks whether a command exists
        elif head in WRAPPERS:
            words |= {head} - BUILTINS
            tokens = tokens[1 + WRAPPERS[head] :]
        else:
            return tokens
    return []


def command_words(script: str) -> set[str]:
    """The commands a shell script runs: a scan, not a full parser, but it follows pipelines, lists,
    $(...) (also in quotes and in arithmetic), wrappers such as timeout, and the command an ssh or
    `bash -c` is given. Functions the script defines and case patterns are not commands."""
    script = re.sub(r"\\\n", " ", script)
    for marker in set(re.findall(r"<<-?\s*'?(\w+)'?", script)):  # a here-document's last line is no command
        script = re.sub(rf"(?m)^\s*{marker}\s*$", "", script)
    script = "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in script.splitlines())
    script = re.sub(
        r"(?ms)(\bcase\b.*?\bin\b)(.*?)(\besac\b)",
        lambda m: m.group(1) + re.sub(r"(?m)^\s*[^()\n;]*\)", "", m.group(2)) + m.group(3),
        script,
    )
    functions = set(re.findall(r"(?m)^\s*([\w-]+)\s*\(\)", script))
    words: set[str] = set()
    for segment in _segments(script, words):
        tokens = _command(shlex.split(segment), words)
        if not tokens or tokens[0].startswith(("$", "-")) or tokens[0] in BUILTINS | functions:
            continue
        words.add(tokens[0].rsplit("/", 1)[-1])
        if tokens[0] == "ssh" and len(tokens) > 2:
            words |= command_words(tokens[-1])
        elif tokens[0] in ("bash", "sh") and "-c" in tokens[:-1]:
            words |= command_words(tokens[tokens.index("-c") + 1])
    return words - functions


def _sent_commands(path) -> list[str]:
    """The literal shell text of each sh(connection, COMMAND) call, interpolations as a value."""
    commands = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "sh"
            and len(node.args) >= 2
        ):
            arg = node.args[1]
            parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
            commands.append(
                "".join(
                    p.value if isinstance(p, ast.Constant) and isinstance(p.value, str) else '"$value"' for p in parts
                )
            )
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and any(getattr(t, "id", "").endswith("_PROBE") for t in node.targets)
        ):
            template = re.sub(r"(?<!\{)\{\w+\}(?!\})", '"$value"', node.value.value)
            commands.append(template.replace("{{", "{").replace("}}", "}"))
    return commands


def _run_commands(path) -> list[str]:
    """The command of each run([COMMAND, ...]) call in a node program (tools.run, subprocess.run)."""
    commands = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "run"
            and node.args
            and isinstance(node.args[0], (ast.List, ast.Tuple))
            and node.args[0].elts
            and isinstance(node.args[0].elts[0], ast.Constant)
        ):
            commands.append(node.args[0].elts[0].value)
    return commands


def container_commands() -> dict[str, set[str]]:
    """Command -> the files that call it inside the container."""
    found: dict[str, set[str]] = {}
    texts = [(p, p.read_text()) for p in SCRIPTS] + [(p, c) for p in SENDERS for c in _sent_commands(p)]
    texts += [(BOOTSTRAP, m) for m in re.findall(r"docker exec \S+ ([^;|&\n]+)", BOOTSTRAP.read_text())]
    request = launch.TrainRequest(recipe="transformer-tiny")  # the spec's mpirun line, run by the supervisor
    texts.append((Path("spec.json"), shlex.join(launch.mpirun_argv(inventory(), request, "eth0", "/c"))))
    # The supervisor's commands (cluster_node/supervisor/nodes.py, hang.py): argv lists and ssh's one-line commands.
    for path in SUPERVISOR:
        source = path.read_text()
        texts += [(path, word) for word in re.findall(r'\[\s*"([\w.-]+)",', source)]
        texts += [(path, line) for line in re.findall(r'f?"(pkill [^"]*)"', source)]
    for path, text in texts:
        for word in command_words(text):
            found.setdefault(word, set()).add(path.name)
    for path in sorted(NODE_PACKAGE.rglob("*.py")):
        for word in _run_commands(path):
            found.setdefault(word, set()).add(path.name)
    return found


def dockerfile_packages() -> set[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    packages = set()
    for install in re.findall(r"apt-get install ([^&\n]*)", text):
        packages |= {word for word in install.split() if not word.startswith("-")}
    return packages


def test_the_scan_sees_the_commands_it_must_see():
    assert command_words(
        'a=$(ip -o addr); if pgrep -x sshd >/dev/null; then x="$(hostname)"; fi\n'
        'timeout 15 ssh -F c h "pkill -KILL orted; true" || true  # awk in a comment\n'
        "command -v nvidia-smi >/dev/null && nvidia-smi | paste -sd/"
    ) == {"ip", "pgrep", "hostname", "timeout", "ssh", "pkill", "nvidia-smi", "paste"}
    found = container_commands()
    assert {"ip", "pgrep", "pkill", "sshd", "ssh", "py-spy", "timeout", "setsid", "mpirun"} <= set(found)
    assert "node-bootstrap.sh" in found["pgrep"]
    assert "probe.py" in found["dmesg"] and "probe.py" in found["dcgmi"]


def test_every_command_run_in_the_container_is_in_the_image():
    found = container_commands()
    unknown = {word: sorted(files) for word, files in found.items() if word not in PROVIDERS}
    assert not unknown, f"commands run in the container with no known provider (add them to PROVIDERS): {unknown}"
    packages = dockerfile_packages()
    pip_packages = {re.split(r"[=<>\s#]", line, maxsplit=1)[0] for line in TRAIN_REQUIREMENTS.read_text().splitlines()}
    missing = {
        word: PROVIDERS[word]
        for word in found
        if PROVIDERS[word] not in (BASE, RUNTIME, OPTIONAL)
        and PROVIDERS[word] not in packages
        and PROVIDERS[word].removeprefix("pip: ") not in pip_packages
    }
    assert not missing, f"install these packages in {DOCKERFILE.name} (pip: in {TRAIN_REQUIREMENTS.name}): {missing}"


def test_the_container_may_trace_its_ranks_where_the_launcher_dumps_stacks_with_py_spy():
    """py-spy reads another process's memory: Docker grants that only with SYS_PTRACE (py-spy's
    README, 'How do I run py-spy in Docker?')."""
    if "py-spy" in container_commands():
        assert "--cap-add SYS_PTRACE" in BOOTSTRAP.read_text()


# ---------------------------------------------------------------- EFA inside the container (issue 19 §2)

ENTRYPOINT = REPO / "assets" / "docker" / "entrypoint.sh"


def _dockerfile_text() -> str:
    return "\n".join(re.sub(r"\s#.*$|^#.*$", "", line) for line in DOCKERFILE.read_text().splitlines())


def test_the_image_installs_the_efa_user_space_and_the_ofi_plugin_the_way_aws_images_do():
    """AWS's own NGC-based images run the EFA installer inside the image with the three container-only
    flags (aws-samples/awsome-distributed-training 0.nvcr-pytorch-aws.dockerfile, nccl-tests.Dockerfile;
    NVIDIA dynamo's aws.Dockerfile); the installer brings libfabric, rdma-core (libibverbs, libefa) and
    aws-ofi-nccl (/opt/amazon/ofi-nccl). Its version is pinned, and the build fails if the plugin is
    not where NCCL_NET_PLUGIN=ofi makes NCCL look (libnccl-net-ofi.so on the library path) or if one
    of its libraries is missing (ldd)."""
    text = _dockerfile_text().replace("\\\n", " ")
    install = re.search(r"efa_installer\.sh([^&\n]*)", text)
    assert install, "the Dockerfile runs no efa_installer.sh"
    assert {"--skip-kmod", "--skip-limit-conf", "--no-verify"} <= set(install.group(1).split())
    version = re.search(r"ARG EFA_INSTALLER_VERSION=(\S+)", text)
    assert version and re.fullmatch(r"\d+\.\d+\.\d+", version.group(1)), "pin the EFA installer's version"
    assert "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" in text
    plugin = f"/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu/libnccl-net-{launch.EFA_PLUGIN}.so"
    assert f"test -e {plugin}" in text and f"ldd {plugin}" in text
    # The installer's efa-profile puts /opt/amazon/openmpi/bin first on a login shell's PATH (fab ssh),
    # where HPC-X's mpirun and OPAL_PREFIX are the launch's: the image drops it.
    assert text.index("rm -f /etc/profile.d/zippy_efa.sh") > install.start()
    path = re.search(r"ENV LD_LIBRARY_PATH=(\S+)", text)
    assert path and {"/opt/amazon/efa/lib", "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu"} <= set(
        path.group(1).split(":")
    )


def test_the_container_has_its_own_efa_libraries_not_the_hosts():
    """The host's /opt/amazon libraries need the host's rdma-core and hwloc, which a container lacks;
    the image has its own: the bootstrap passes only the EFA devices, the entrypoint adds no host path."""
    bootstrap = BOOTSTRAP.read_text()
    assert "--device" in bootstrap and "EFA_DEVICES=${EFA_DEVICES:-/dev/infiniband}" in bootstrap
    assert '"$EFA_DEVICES"/uverbs*' in bootstrap
    assert not re.search(r"-v\s+/opt/amazon", bootstrap)
    assert "/opt/amazon" not in "\n".join(
        line for line in ENTRYPOINT.read_text().splitlines() if not line.lstrip().startswith("#")
    )


def test_the_image_has_the_source_of_every_data_set_fab_data_prepares_offline():
    """`fab data` runs prepare.py in the container on the head node: the `ding` data set reads
    Debian's trans-de-en there, so the image must install that package (Ubuntu, under the NGC base,
    ships it in universe as Debian does)."""
    from train import ding

    assert ding.PACKAGE in image_apt_packages()


def image_apt_packages() -> set[str]:
    """Every package the Dockerfile installs with apt-get, the optional data-set loop's included."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    words = " ".join(re.findall(r"apt-get install ([^&\n]*)", text) + re.findall(r"for package in ([^;]*);", text))
    return set(words.split())


def test_the_image_build_imports_every_node_module_the_entrypoint_and_fab_run():
    """The emulated nodes run the laptop's venv, which finds cluster_node and train whatever PYTHONPATH
    says: only the image build can catch a wrong COPY, PYTHONPATH or module name (a fresh read of the
    deploy path). The Dockerfile's smoke import must name every `python -m cluster_node.X` the
    entrypoint, fab and the supervisor run."""
    sources = [*(REPO / "clusterops").rglob("*.py"), *(REPO / "assets" / "cluster_node").rglob("*.py")]
    sources.append(REPO / "assets" / "docker" / "entrypoint.sh")
    run = set()
    for path in sources:
        text = path.read_text()
        run |= set(re.findall(r"""-m["', ]+(cluster_node[.][a-z_.]+[a-z])""", text))
        run |= {f"cluster_node.{m}" for m in re.findall(r'node_command[(]\s*\w+,\s*"([a-z_.]+)"', text)}
    dockerfile = DOCKERFILE.read_text()
    smoke = re.search(r'RUN cd / && python -c "import ([^"]+)"', dockerfile.replace("\\\n", ""))
    assert smoke, "the Dockerfile has no build-time import of the node modules"
    imported = {name.strip() for name in smoke.group(1).split(",")}
    assert run and run <= imported, f"run on the nodes but not imported at build: {sorted(run - imported)}"
    assert "ENV PYTHONPATH=/workspace${PYTHONPATH:+:${PYTHONPATH}}" in dockerfile


def test_the_base_images_pythonpath_survives_the_pythonpath_fab_gives_ranks(tmp_path):
    """fab hands ranks `-x PYTHONPATH=ROOT` (launch.rank_program), which replaces whatever the NGC base image
    put there; the build keeps those entries in a .pth file (site.py reads it whatever PYTHONPATH says). Its
    RUN, run by a fresh venv's Python with a base PYTHONPATH of two directories: a rank's sys.path has both."""
    dockerfile = DOCKERFILE.read_text()
    (run,) = [line for line in dockerfile.splitlines() if line.startswith("RUN ") and ".pth" in line]
    assert dockerfile.index(run) < dockerfile.index("ENV PYTHONPATH=/workspace"), "it must see the base's value"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    base = [tmp_path / "base-a", tmp_path / "base-b"]
    for directory in base:
        directory.mkdir()
    python = str(tmp_path / "venv" / "bin" / "python")
    command = run[len("RUN ") :].replace("python -c", f"{shlex.quote(python)} -c", 1)
    subprocess.run(
        ["sh", "-c", command], check=True, env={"PYTHONPATH": ":".join(map(str, base)), "PATH": "/usr/bin:/bin"}
    )
    rank = subprocess.run(
        [python, "-c", "import sys; print(sys.path)"], env={"PYTHONPATH": "/workspace"}, capture_output=True, text=True
    )
    assert all(str(directory) in rank.stdout for directory in base), rank.stdout


def _efa_run_instruction() -> str:
    """The Dockerfile's RUN that calls the EFA installer, as its shell (/bin/sh -c) gets it."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    (run,) = [line for line in text.splitlines() if line.startswith("RUN ") and "efa_installer.sh" in line]
    return run[len("RUN ") :]


def test_the_efa_installer_runs_only_in_an_efa_nodes_image(tmp_path):
    """Issue 28: every image build ran the EFA installer (a download from efa-installer.amazonaws.com,
    then apt), g4dn/g5 without EFA included, so every deploy depended on it. The build arg EFA (0 by
    default; the bootstrap passes 1 where the node has EFA interfaces) gates it. The RUN's own shell
    text runs here under /bin/sh with recording stand-ins for the commands it would call."""
    assert re.search(r"^ARG EFA=0$", DOCKERFILE.read_text(), re.M)
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for name in ("apt-get", "dpkg-query", "curl", "tar", "ldconfig"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n[ {name} != curl ]\n')
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "EFA_INSTALLER_VERSION": "1.43.3"}
    off = subprocess.run(["sh", "-c", _efa_run_instruction()], env={**env, "EFA": "0"}, capture_output=True)
    assert off.returncode == 0 and not log.exists(), off.stderr
    on = subprocess.run(["sh", "-c", _efa_run_instruction()], env={**env, "EFA": "1"}, capture_output=True)
    calls = log.read_text().splitlines()
    assert on.returncode != 0 and calls[0] == "apt-get update"  # the stand-in download fails: so does the build
    assert any(c.startswith("curl ") and "aws-efa-installer-1.43.3.tar.gz" in c for c in calls)


def test_the_entrypoint_is_executable_in_the_image_whatever_mode_the_asset_zip_gave_it():
    """CDK zips the image context with each file's mode as the checkout has it (cdk-assets' zip: `mode:
    stat.mode`); a checkout without file modes (git on Windows, core.fileMode=false) gives 0644 and
    `docker run` fails "permission denied" at start-container. The image sets the mode itself."""
    text = DOCKERFILE.read_text()
    (entrypoint,) = re.findall(r'^ENTRYPOINT \["([^"]+)"\]', text, re.M)
    copy = re.search(rf"^COPY \S+ {re.escape(entrypoint)}$", text, re.M)
    chmod = re.search(rf"^RUN chmod 0755 {re.escape(entrypoint)}$", text, re.M)
    assert copy and chmod and copy.start() < chmod.start()
