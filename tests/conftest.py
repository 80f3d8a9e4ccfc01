"""Shared fixtures. Everything runs offline with the real tools (CDK CLI, sshd, mpirun, moto server)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAIN_DIR = REPO / "assets" / "train"
for path in (REPO, TRAIN_DIR):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

OFFLINE_ENV = {"CDK_DISABLE_VERSION_CHECK": "1", "CDK_DISABLE_CLI_TELEMETRY": "true",
               "AWS_EC2_METADATA_DISABLED": "true", "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
               "JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION": "1"}
os.environ.update(OFFLINE_ENV)


def tool_env(**extra: str) -> dict:
    """Environment for subprocesses: the venv and node_modules first on PATH."""
    env = dict(os.environ, **OFFLINE_ENV, **extra)
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{REPO / 'node_modules' / '.bin'}:{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="session")
def numbers_data(tmp_path_factory) -> Path:
    """A small numbers data set, prepared once per session by the real prepare.py."""
    import prepare
    out = tmp_path_factory.mktemp("numbers")
    prepare.main(["numbers", "--out", str(out), "--train", "6000", "--valid", "200", "--test", "100",
                  "--vocab", "400"])
    return out
