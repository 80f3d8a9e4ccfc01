"""The NGC image's environment on the emulated cluster: every SSH session and, through mpirun's daemons, every
rank on the other nodes gets the image's ENV (its relocated HPC-X Open MPI's OPAL_PREFIX, its own variables)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from clusterops.local import cluster as localcluster

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")]

IMAGE_ENV = {
    "NGC_IMAGE_ONLY": "set by the image, with spaces",
    "IMAGE_SYMBOLS": "it's # $HOME %h\tend",
    "IMAGE_EMPTY": "",
    "IMAGE_LONG": "x" * 6000,
}
IMAGE_ENV_PROBE = (
    "import json, os, socket; print(json.dumps({'host': socket.gethostname(), 'env': {k: v for k, v in "
    "os.environ.items() if k.startswith(('IMAGE_', 'NGC_', 'OPAL_')) or k in ('PATH', 'LD_LIBRARY_PATH')}}))"
)
# Where NCCL finds the EFA image's OFI plugin (Dockerfile's LD_LIBRARY_PATH): by that variable only.
OFI_LIBS = "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib"


def test_ssh_sessions_and_ranks_mpirun_starts_on_other_nodes_get_the_image_environment(tmp_path):
    """The NGC image's ENV (OPAL_PREFIX for its relocated HPC-X Open MPI, its own variables) must
    reach every SSH session and, through mpirun's daemons, the ranks on the other nodes. The host's
    Open MPI is not relocated: OPAL_PREFIX names its real prefix, so mpirun also runs with it set."""
    from clusterops.nodes import remote
    from clusterops.run import launch

    prefix = (
        subprocess.run(["ompi_info", "--path", "prefix", "--parsable"], capture_output=True, text=True, check=True)
        .stdout.strip()
        .split(":", 2)[2]
    )
    # The image's PATH first names HPC-X's bin (its mpirun, the orted mpirun starts on the other nodes): here a
    # folder of its own, so sshd's default PATH (the host's mpirun and python are on it) cannot pass for it.
    path = f"{tmp_path / 'hpcx-bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    carried = {**IMAGE_ENV, "OPAL_PREFIX": prefix, "PATH": path, "LD_LIBRARY_PATH": OFI_LIBS}
    image_env = {**carried, "IMAGE_QUOTED": 'say "hi"'}
    wanted = carried  # a double quote: left out, and logged
    spec = localcluster.LocalSpec(name="te", nodes=2, subnet="10.213.150.0/24")
    inventory = localcluster.up(spec, tmp_path / "inventory.json", image_env=image_env)
    try:
        with remote.connect(inventory, inventory.nodes[1]) as conn:
            session = json.loads(remote.sh(conn, f"{inventory.python} -c {shlex.quote(IMAGE_ENV_PROBE)}"))
        assert session == {"host": "node1", "env": wanted}
        argv = launch.mpirun_argv(inventory, launch.TrainRequest(recipe="transformer-tiny"), "eth0", inventory.code_dir)
        # Each rank writes its own file on /data: two >4 KB lines through mpirun's stdout can interleave.
        to_file = f"import sys, socket; sys.stdout = open('{inventory.data_dir}/env-' + socket.gethostname(), 'w')"
        argv = argv[: argv.index(inventory.python)] + [inventory.python, "-c", f"{to_file}; {IMAGE_ENV_PROBE}"]
        with remote.connect(inventory, inventory.head) as conn:
            out = remote.sh(conn, "timeout 120 " + shlex.join(argv))
        shared = localcluster.STATE_ROOT / "te" / "shared"
        ranks = [json.loads((shared / f"env-{host}").read_text()) for host in ("node0", "node1")]
        assert [r["host"] for r in ranks] == ["node0", "node1"], out
        for rank in ranks:  # Open MPI may put its own bin and lib first for the daemons it starts
            for name in ("PATH", "LD_LIBRARY_PATH"):
                assert rank["env"].pop(name).endswith(wanted[name]), (name, rank)
            assert rank["env"] == {k: v for k, v in wanted.items() if k not in ("PATH", "LD_LIBRARY_PATH")}
        log = (localcluster.STATE_ROOT / "te" / "node1.log").read_text()
        assert "IMAGE_QUOTED is not carried into SSH sessions" in log
    finally:
        localcluster.down("te", tmp_path / "inventory.json")
