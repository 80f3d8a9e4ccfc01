"""shellcheck on every shell script the project ships, and on the user-data the stack renders."""

import subprocess

from conftest import REPO

from stacks.userdata import USER_DATA_KEYS, render_user_data


def _bash_scripts() -> list[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    scripts = []
    for name in tracked:
        path = REPO / name
        if name.endswith(".sh") or (
            path.is_file() and path.read_bytes()[:40].startswith((b"#!/usr/bin/env bash", b"#!/bin/bash"))
        ):
            scripts.append(name)
    return scripts


def test_shellcheck_every_script():
    scripts = _bash_scripts()
    assert {
        "assets/bootstrap/node-bootstrap.sh",
        "assets/docker/entrypoint.sh",
        "tests/supervisor_standins/mpirun",
        "scripts/setup.sh",
        "tests/standins/docker",
    } <= set(scripts)
    result = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_shellcheck_the_rendered_user_data(tmp_path):
    env = {key: "value" for key in USER_DATA_KEYS} | {"CLUSTER_NAME": "c", "NODE_RANK": "0", "FILE_SYSTEM_ID": "fs-1"}
    path = tmp_path / "user-data.sh"
    path.write_text("#!/bin/bash\n" + render_user_data(env))
    result = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
