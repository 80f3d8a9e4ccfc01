"""The launcher's decisions after a failed attempt, run on the head node next to health.py (both are
uploaded into the run directory by `fab train`; stdlib only):

    supervise.py hang RUN_DIR              name the rank behind (heartbeats, stacks, process states)
    supervise.py spot RUN_DIR SINCE        did the attempt started at SINCE (epoch s) end early
                                           because one of its nodes got a Spot notice? (exit 0: yes)
    supervise.py plan RUN_DIR KIND REASON [SINCE]
                                           judge every node of the original set from its probe
                                           output (and, for KIND spot, its Spot notices since SINCE),
                                           pick the healthy ones and rewrite hostfile and
                                           command.sh for a restart on them (same global batch)

`plan` prints one line; exit 0 means "restart", 1 means "give up" (the line says why). Every restart
is appended to RUN_DIR/restarts.json: when, why, which nodes, the step it resumes at."""

from __future__ import annotations

import calendar
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

try:
    from cluster_node import health
except ImportError:  # on the head node: a plain script beside health.py
    import health  # type: ignore[no-redef]


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)


def heartbeats(run_dir: Path) -> dict[int, dict]:
    """Per rank: its last finished step, pid, host and when it wrote that."""
    out = {}
    for path in (run_dir / "ranks").glob("rank*"):
        try:
            step, pid, host = path.read_text().split()[:3]
            out[int(path.name[4:])] = {"step": int(step), "pid": int(pid), "host": host, "time": path.stat().st_mtime}
        except (OSError, ValueError):
            continue
    return out


def states(run_dir: Path) -> dict[int, str]:
    """pid -> process state letter, from the `pid state` lines the launcher collected per host."""
    out = {}
    for path in (run_dir / "stacks").glob("states.*"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                out[int(parts[0])] = parts[1]
    return out


def behind(run_dir: Path) -> tuple[Optional[int], str]:
    """The rank that is behind: a stopped process (state T) or one whose stack dump never came, else
    the lowest step, else the oldest heartbeat. Returns (rank, one line with the evidence)."""
    beats, procs = heartbeats(run_dir), states(run_dir)
    if not beats:
        return None, "no rank wrote a heartbeat"
    dumps = {r: run_dir / "stacks" / f"rank{r}.txt" for r in beats}
    stacks = {r for r, path in dumps.items() if path.exists() and path.stat().st_size > 0}

    def suspicion(rank: int) -> tuple:
        beat = beats[rank]
        return (procs.get(beat["pid"]) != "T", rank in stacks, beat["step"], beat["time"])

    rank = min(beats, key=suspicion)
    beat = beats[rank]
    state = procs.get(beat["pid"], "?")
    evidence = (
        f"rank {rank} (pid {beat['pid']} on {beat['host']}) is behind: step {beat['step']}, process state "
        f"{state}{' (stopped)' if state == 'T' else ''}, {'stack dumped' if rank in stacks else 'no stack dump'}; "
        f"steps per rank {dict(sorted((r, b['step']) for r, b in beats.items()))}"
    )
    return rank, evidence


def last_checkpoint_step(run_dir: Path) -> Optional[int]:
    steps = [
        int(m.group(1))
        for p in (run_dir / "checkpoints").glob("step_*.pt")
        if (m := re.match(r"step_(\d+)\.pt$", p.name))
    ]
    return max(steps) if steps else None


def rebalance(global_batch: int, ranks: int, max_per_rank: int) -> Optional[tuple[int, int]]:
    """(batch per rank, accumulation) giving `global_batch` over `ranks` with micro-batches of at
    most `max_per_rank`; None when the global batch does not split evenly over the ranks."""
    if global_batch % ranks:
        return None
    share = global_batch // ranks
    for accum in range(1, share + 1):
        if share % accum == 0 and share // accum <= max_per_rank:
            return share // accum, accum
    return None


def judge(run_dir: Path, hosts: list[str], gpus_per_node: int) -> dict[str, list[str]]:
    """host -> reasons it must not train (empty: healthy), from RUN_DIR/probes/HOST (probe output)."""
    facts: dict[str, Optional[dict]] = {}
    for host in hosts:
        try:
            facts[host] = health.parse_probe((run_dir / "probes" / host).read_text())
        except (OSError, ValueError, IndexError):
            facts[host] = None
    verdicts = health.assess(facts, gpus_per_node if any(f and f["gpus"] for f in facts.values()) else 0, None)
    return {v.node: (v.reasons if v.verdict == "bad" else []) for v in verdicts}


def interrupted(run_dir: Path, since: float) -> dict[str, str]:
    """host -> its Spot notice, for the notices the nodes' watchers recorded (RUN_DIR/interruptions.json,
    spotwatch.py) at or after `since` (epoch s; the record keeps whole seconds)."""
    out = {}
    for entry in read_json(run_dir / "interruptions.json", []):
        try:
            noticed = calendar.timegm(time.strptime(entry["noticed"], "%Y-%m-%dT%H:%M:%SZ"))
        except (KeyError, TypeError, ValueError):
            continue
        if entry.get("host") and noticed >= int(since):
            when = entry.get("action_time") or "an unknown time"
            out[entry["host"]] = f"Spot {entry.get('action', 'interruption')} at {when}"
    return out


def spot_ended(run_dir: Path, since: float) -> Optional[str]:
    """Why to restart an attempt that ended cleanly, but early, because one of its nodes got a Spot
    notice since `since` (its watcher asked the trainer to checkpoint now); None otherwise."""
    current = [line.split()[0] for line in (run_dir / "hostfile").read_text().splitlines() if line.strip()]
    hit = {host: why for host, why in interrupted(run_dir, since).items() if host in current}
    progress, config = read_json(run_dir / "progress.json", {}), read_json(run_dir / "config.json", {})
    if not hit or progress.get("step", 0) >= config.get("max_steps", float("inf")):
        return None
    return "spot notice: " + "; ".join(f"{host}: {why}" for host, why in hit.items())


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        index = argv.index(flag)
        return argv[: index + 1] + [value] + argv[index + 2 :]
    return argv + [flag, value]


def relaunch_argv(
    argv: list[str], hosts: list[str], slots: int, batch: tuple[int, int], global_batch: int
) -> list[str]:
    """The attempt's mpirun line for `hosts`: rank count, rendezvous on the first host, the
    rebalanced batch and accumulation that keep the global batch."""
    argv = with_flag(argv, "-np", str(len(hosts) * slots))
    argv = [f"MASTER_ADDR={hosts[0]}" if a.startswith("MASTER_ADDR=") else a for a in argv]
    argv = with_flag(argv, "--batch-per-gpu", str(batch[0]))
    argv = with_flag(argv, "--grad-accum", str(batch[1]))
    return with_flag(argv, "--keep-global-batch", str(global_batch))


def launch_settings(run_dir: Path) -> dict[str, str]:
    """KEY=value lines of RUN_DIR/launch.env (values shell-quoted by fab train)."""
    out = {}
    for line in (run_dir / "launch.env").read_text().splitlines():
        key, _, value = line.partition("=")
        out[key] = " ".join(shlex.split(value))
    return out


def plan(
    run_dir: Path, kind: str, reason: str, now: Optional[float] = None, since: Optional[float] = None
) -> tuple[bool, str]:
    """After a failed attempt: restart on the healthy nodes of the original set, or give up. After a
    Spot notice (kind spot) the noticed nodes are left out too: they still answer, for two minutes.
    Rewrites hostfile and command.sh and appends to restarts.json when it restarts."""
    env = launch_settings(run_dir)
    original, slots = env["HOSTS"].split(), int(env.get("SLOTS", "1"))
    allowed, min_nodes = int(env.get("MAX_RESTARTS", "0")), int(env.get("MIN_NODES", "1"))
    history = read_json(run_dir / "restarts.json", [])
    if len(history) >= allowed:
        return False, f"restarts exhausted ({len(history)}/{allowed})"
    current = [line.split()[0] for line in (run_dir / "hostfile").read_text().splitlines() if line.strip()]
    config = read_json(run_dir / "config.json", {})
    if not config:
        return False, "no config.json: the run never started training, nothing to resume"
    global_batch = (
        history[-1]["global_batch"]
        if history
        else config["batch_per_gpu"] * config["grad_accum"] * len(current) * slots
    )
    max_per_rank = history[0]["max_batch_per_gpu"] if history else config["batch_per_gpu"]
    verdicts = judge(run_dir, original, slots)
    if kind == "spot":
        for host, why in interrupted(run_dir, since or 0).items():
            verdicts[host] = [*verdicts.get(host, []), why]
    healthy = [h for h in original if not verdicts.get(h)]
    dropped = {h: "; ".join(verdicts[h]) for h in original if verdicts.get(h)}
    if len(healthy) < min_nodes:
        return False, f"{len(healthy)} healthy node(s) left, --min-nodes {min_nodes} (dropped: {dropped})"
    batch = rebalance(global_batch, len(healthy) * slots, max_per_rank)
    if batch is None:
        return False, f"the global batch {global_batch} does not split evenly over {len(healthy) * slots} ranks"
    argv = relaunch_argv(json.loads((run_dir / "command.json").read_text()), healthy, slots, batch, global_batch)
    exports = [line for line in (run_dir / "command.sh").read_text().splitlines() if line.startswith("export ")]
    (run_dir / "hostfile").write_text("".join(f"{h} slots={slots}\n" for h in healthy))
    (run_dir / "command.sh").write_text("\n".join(exports + ["exec " + shlex.join(argv)]) + "\n")
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "kind": kind,
        "reason": reason,
        "nodes_before": current,
        "nodes_after": healthy,
        "dropped": dropped,
        "rejoined": [h for h in healthy if h not in current],
        "resume_step": last_checkpoint_step(run_dir),
        "global_batch": global_batch,
        "batch_per_gpu": batch[0],
        "grad_accum": batch[1],
        "max_batch_per_gpu": max_per_rank,
    }
    write_json(run_dir / "restarts.json", history + [record])
    return True, (
        f"restart {len(history) + 1}/{allowed} on {len(healthy)} node(s) {' '.join(healthy)} from step "
        f"{record['resume_step']}, batch {batch[0]}/rank x accumulation {batch[1]} (global {global_batch})"
        + (f"; dropped {dropped}" if dropped else "")
    )


def main(argv: list[str]) -> int:
    command, run_dir = argv[0], Path(argv[1])
    if command == "hang":
        rank, evidence = behind(run_dir)
        hangs = read_json(run_dir / "hangs.json", [])
        write_json(run_dir / "hangs.json", hangs + [{"time": time.time(), "rank": rank, "evidence": evidence}])
        print(evidence)
        return 0
    if command == "spot":
        why = spot_ended(run_dir, float(argv[2]))
        print(why or "no Spot notice in this attempt")
        return 0 if why else 1
    restart, line = plan(run_dir, argv[2], argv[3], since=float(argv[4]) if len(argv) > 4 else None)
    print(line)
    return 0 if restart else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def history_lines(restarts: list[dict]) -> list[str]:
    """restarts.json for people: one line per restart."""
    return [
        f"  restart {i}: {r['time']} {r['kind']}: {r['reason'][:160]}; resumed at step {r['resume_step']} on "
        f"{len(r['nodes_after'])} node(s) {' '.join(r['nodes_after'])}"
        + (f", dropped {', '.join(r['dropped'])}" if r["dropped"] else "")
        + (f", rejoined {', '.join(r['rejoined'])}" if r["rejoined"] else "")
        for i, r in enumerate(restarts, 1)
    ]
