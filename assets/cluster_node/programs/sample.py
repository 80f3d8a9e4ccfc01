"""One `fab monitor` sample of this node: python -m cluster_node.programs.sample IFACE SECONDS prints
`rx_bytes tx_bytes seconds cores ncpu gpu_util` on one line (gpu_util: a/b/... per GPU, or none).
Per node, not per host: CPU is the time of the processes in this node's network namespace (one
namespace per emulated node; on AWS the container shares the host's, so it is the host's)."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, Sequence

from cluster_node.tools import run


def net(iface: str) -> tuple[int, int]:
    """Bytes received and sent on `iface` so far (/proc/net/dev)."""
    with open("/proc/net/dev") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return 0, 0


def cpu_ticks(namespace: str) -> dict[str, int]:
    """pid -> CPU ticks so far, for the processes of this network namespace."""
    ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") == namespace:
                with open(f"/proc/{pid}/stat") as handle:
                    fields = handle.read().rpartition(")")[2].split()
                ticks[pid] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return ticks


def sample(iface: str, interval: float) -> list:
    mine = os.readlink("/proc/self/ns/net")
    (rx0, tx0), before, t0 = net(iface), cpu_ticks(mine), time.monotonic()
    time.sleep(interval)
    (rx1, tx1), after, t1 = net(iface), cpu_ticks(mine), time.monotonic()
    # Per process: one that ended in between must not subtract its whole life (a new pid counts from 0).
    used = sum(max(0, n - before.get(pid, 0)) for pid, n in after.items())
    _, out = run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"], timeout=10)
    cores = used / os.sysconf("SC_CLK_TCK") / (t1 - t0)
    return [rx1 - rx0, tx1 - tx0, t1 - t0, f"{cores:.2f}", os.cpu_count(), "/".join(out.split()) or "none"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m cluster_node.programs.sample IFACE SECONDS", file=sys.stderr)
        return 2
    print(*sample(args[0], float(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
