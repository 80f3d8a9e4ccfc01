"""A node's health facts as one JSON line, for `fab check`, `fab train` and the launcher's probes
before a restart (cluster_node.programs.health judges them): python -m cluster_node.programs.probe --data /data

nvidia-smi --query-gpu fields (NVIDIA's nvidia-smi manual, `--help-query-gpu`): name, driver_version and
ecc.errors.uncorrected.volatile.total ("[N/A]" where the GPU has no ECC). Xids are the driver's
"NVRM: Xid (PCI:0000:01:00): 79, ..." kernel-log lines (dmesg, else the kernel journal). DCGM's quick
diagnostic (`dcgmi diag -r 1`, exit status non-zero on a failed test) runs only where dcgmi exists."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from cluster_node.programs import snapshots
from cluster_node.protocol import clusterdir, rundir
from cluster_node.tools import have, is_mountpoint, run

XID = re.compile(r"NVRM: Xid \([^)]*\): ([0-9]+)")


def gpus() -> tuple[str, list[dict]]:
    """(nvidia-smi's verdict: absent, ok or failed: FIRST LINE; one record per GPU)."""
    if not have("nvidia-smi"):
        return "absent", []
    code, out = run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,ecc.errors.uncorrected.volatile.total",
            "--format=csv,noheader",
        ],
        merge=True,
    )
    if code != 0:
        return f"failed: {(out.splitlines() or [''])[0]}", []
    rows = []
    for line in filter(None, (line.strip() for line in out.splitlines())):
        name, driver, ecc = (part.strip() for part in line.split(",")[:3])
        rows.append({"name": name, "driver": driver, "ecc_uncorrected": int(ecc) if ecc.isdigit() else None})
    return "ok", rows


def xids() -> tuple[list[int], str]:
    """The Xids in the kernel log and where it was read."""
    code, klog = run(["dmesg"])
    source = "dmesg"
    if code != 0:
        code, klog = run(["journalctl", "-k", "-q", "--no-pager"])
        source = "kernel journal"
    if code != 0:
        return [], "not available"
    return [int(x) for x in sorted(set(XID.findall(klog)))], source


def dcgm() -> str:
    if not have("dcgmi"):
        return "not available"
    code, out = run(["dcgmi", "diag", "-r", "1"], timeout=120, merge=True)
    if code == 0:
        return "pass"
    if "connect" in out.lower():
        return "not available (no DCGM host engine)"
    failed = [line for line in out.splitlines() if "fail" in line.lower()]
    return f"fail: {failed[0] if failed else ''}"


def writable(data: Path) -> bool:
    """Write, then remove, a file of this probe's own under DATA/.cluster."""
    probe = data / clusterdir.CLUSTER / clusterdir.HEALTH_PROBE_FILE.format(host=socket.gethostname(), pid=os.getpid())
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok\n")
        probe.unlink()
        return True
    except OSError:
        return False


def free_gb(data: Path) -> float:
    try:
        return shutil.disk_usage(data).free // 1024 / 1e6  # df -Pk's available KiB, as before
    except OSError:
        return 0.0


def versions(have_gpus: bool) -> dict:
    """torch, its CUDA and NCCL. Without a GPU, torch's build facts without importing it (1-2 s on a
    busy node, before every launch); NCCL's version needs torch and CUDA loaded."""
    try:
        if have_gpus:
            import torch

            nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
            return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}
        import importlib.util

        spec = importlib.util.find_spec("torch")
        build: dict = {}
        exec(Path(str(spec.origin if spec else "")).with_name("version.py").read_text(), build)  # noqa: S102
        return {"torch": build["__version__"], "cuda": build["cuda"], "nccl": None}
    except Exception as error:  # noqa: BLE001 - a broken torch is a finding, not a crash
        return {"torch": f"unusable: {error}"}


def copy_state(path: Path) -> dict:
    """A data set staged onto this node's own disk (`fab train --data`): staged (whole, with its record), present
    (copied by other means), unfinished (a staging cut off) or missing (never, or a stop erased the instance store)."""
    if (path / clusterdir.STAGING_MARKER).exists():
        state = "unfinished"
    elif (path / clusterdir.STAGED_MARKER).exists():
        state = "staged"
    else:
        state = "present" if (path / "train").is_dir() or (path / "meta.json").is_file() else "missing"
    return {"path": str(path), "state": state}


def facts(data: Path, copy: Optional[Path] = None) -> dict:
    smi, found = gpus()
    xid_list, xid_source = xids()
    return {
        "time": time.time(),
        "hostname": socket.gethostname().split(".")[0],
        "mounted": is_mountpoint(data),
        "writable": writable(data),
        "free_gb": free_gb(data),
        "gpus": found,
        "nvidia_smi": smi,
        "xids": xid_list,
        "xid_source": xid_source,
        "dcgm": dcgm(),
        **versions(bool(found)),
        "snapshots": snapshots.held(rundir.snapshot_root()),  # what a restart can resume from (issue 30)
        **({"copy": copy_state(copy)} if copy else {}),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster_node.programs.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/data", help="the shared file system")
    parser.add_argument("--copy", help="a run's data set on this node's own disk (fab train --data)")
    args, _ = parser.parse_known_args(argv)  # a newer fab's option this node's code lacks is no failed probe
    print(json.dumps(facts(Path(args.data), Path(args.copy) if args.copy else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
