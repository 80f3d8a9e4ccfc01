"""DATA/.cluster, written down once: the cluster-wide files beside the runs (SSH identity, readiness
marks, the idle watchdog's and Spot watcher's files, fab check's verdicts). rundir.py has the run directory;
protocol.py tabulates both."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

CLUSTER = ".cluster"
SSH_DIR = "ssh"
SSH_LOCK = "ssh.lock"
READY_DIR = "ready"  # ready/nodeN
READY_FORMAT = "`TIME INSTANCE_ID`, the node's bootstrap finished"
NODE_MARK = "node{rank}"
DEPLOY_DIR = "deploy"  # deploy/nodeN: the node's deploy timeline (node-bootstrap.sh), see DEPLOY_FORMAT
DEPLOY_FORMAT = "`STEP START END [failed]` lines, epoch s"
HEARTBEAT_DIR = "heartbeat"  # heartbeat/nodeN.json
AUTOSTOP_DIR = "autostop"  # autostop/nodeN.json
NODE_JSON = "node{rank}.json"
AUTOSTOP_LOG = "autostop.log"
AUTOSTOP_NODE_LOG = "autostop-node{rank}.log"
SPOT_NODE_LOG = "spot-node{rank}.log"
BUSY_DIR = "busy"  # busy/HOST-PID.json
BUSY_MARKER = "{host}-{pid}.json"
LINK_JSON = "link.json"
TRANSPORT_JSON = "transport.json"
HEALTH_PROBE_FILE = "health.{host}.{pid}"
# A copy staged onto a node's own disk (train.imagenet.stage; `fab train --data`, the probe's --copy): the first
# marker is written when the copy starts and removed once the second, its record (files, bytes, source), is written.
STAGING_MARKER = ".staging"
STAGED_MARKER = ".staged.json"
DRILL_FILL = "drill-fill.{host}"  # fab drill fill-data: a bounded file, removed afterwards


def node_json(data_dir: Union[str, os.PathLike], folder: str, rank: Union[int, str]) -> Path:
    """DATA/.cluster/FOLDER/nodeN.json, FOLDER = HEARTBEAT_DIR or AUTOSTOP_DIR."""
    return Path(data_dir) / CLUSTER / folder / NODE_JSON.format(rank=rank)


def node_file(data_dir: Union[str, os.PathLike], folder: str, name: str) -> Path:
    """DATA/.cluster/FOLDER/NAME, FOLDER = READY_DIR or DEPLOY_DIR, NAME = nodeN (the bootstrap writes them)."""
    return Path(data_dir) / CLUSTER / folder / name


def ready_instances(data_dir: Union[str, os.PathLike]) -> set[str]:
    """The instance ids the ready marks name (a node replaced under the same rank writes its own)."""
    found: set[str] = set()
    for mark in (Path(data_dir) / CLUSTER / READY_DIR).glob("node*"):
        try:
            fields = mark.read_text().split()
        except OSError:  # removed meanwhile
            continue
        found.update(f for f in fields[1:2] if f.startswith("i-"))
    return found
