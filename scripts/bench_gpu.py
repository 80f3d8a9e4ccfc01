"""The trainer against plain PyTorch loops on one GPU (issue 29), in one run of at most ~6 minutes:

    PYTHONPATH=assets python3 scripts/bench_gpu.py --json bench-gpu.json  # a GPU machine, from the repo root
    python scripts/bench_gpu.py --smoke --json /tmp/smoke.json             # a CPU (the set-up's venv): seconds

(The venv installs the packages `train` and `cluster_node`; a GPU machine's own Python finds them in
assets/ through PYTHONPATH, which every process the benchmark starts inherits.)

Every measurement is a fresh process, cold like a real start: each trainer a `python -m train.train` (its
figures from its summary.json, its step times from its TensorBoard scalars), each plain loop this script with
--peer. (A smoke run forks its trainers from a server that imported torch once: a CPU's start-up is not what
it measures.) In order of importance, each skipped when --budget-s would be passed: transformer-base at the
recipe's token budget, stopped and resumed (a new process: the after-resume warm-up), the plain loop fed the
trainer's own batches with padding masks for as many steps (flash/efficient pinned; its figures in the same
form, and the two compared step for step) and at one fixed shape of the same tokens (baseline.py); the same
Transformer runs at 16k tokens a step; the budget's trainer with no batch shape warmed before step 1, and
with its step's flags set element by element as before session 28 (each a wait for the stream); ResNet-50 on
a synthetic batch against the plain loop, and on generated JPEGs (and those decoded image by image, stacked
and copied again at the worker's queue, as before session 28); the budget's trainer with
lengths to a multiple of 4 (its pairs a second: other batches); then the variants (--attention torch,
--pad-multiple 1), the plain loop with torch's own SDPA choice (cuDNN on Hopper); kernel launches from one
thread while another allocates a snapshot's host buffers four ways and while they are held, and the snapshot's
copy into pinned and pageable memory (gpu_peers.launch_contention), and the budget's trainer with those
buffers not reserved, pageable (as it trains), page-locked and pageable again (patched_trainer); ResNet-50 in
bf16 and the budget's trainer with --compile (not in a smoke run: a CPU compiles for minutes). Data: Ding-like
lengths (gpu_peers.text_data).
Prints one table, the step times by window and the issue's bounds, and writes --json; every measurement
is tried on its own (an error is printed and recorded, the rest still run). --profile runs only the
trainer and its plain peers (its batches, one fixed shape) over the same steps under torch.profiler, side
by side (about two minutes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import gpu_peers as peers
    import gpu_report
    import torch

    from cluster_node.protocol import rundir
except ModuleNotFoundError as missing:  # a GPU machine's Python without the venv's packages
    sys.exit(f"error: {missing} (it needs torch, and assets/ on PYTHONPATH outside the venv: see its first lines)")

SIZES = {
    "gpu": dict(
        model=[], budget=[], vocab=8000, pairs=18000, steps=300, resume=120, big=16384, big_steps=200,
        resnet=["--batch-per-gpu", "256"], r_batch=256, r_size=224, r_width=64, r_steps=200,
        jpeg=(50, 80, 1.0), j_args=["--workers", "15"], j_steps=150, profile=(231, 250),
    ),
    "smoke": dict(
        model=["--d-model", "32", "--layers", "1", "--heads", "2", "--ffn", "64", "--max-len", "64"],
        budget=["--max-tokens", "256"], vocab=300, pairs=1500, steps=60, resume=50, big=512, big_steps=60,
        resnet=["--batch-per-gpu", "4", "--width", "8", "--image-size", "32"], r_batch=4, r_size=32, r_width=8,
        r_steps=10, jpeg=(2, 4, 0.15), j_args=["--workers", "1"], j_steps=6, profile=(5, 9),
    ),
}  # fmt: skip
# Estimated seconds per measurement on an H100, for the budget's skips.
ESTIMATE = {"trainer": 40, "resume": 25, "plain": 35, "resnet": 45, "jpeg": 60, "contention": 30, "compile": 240}


class Bench:
    def __init__(self, args, tmp: Path):
        self.args, self.tmp = args, tmp
        self.size = SIZES["smoke" if args.smoke else "gpu"]
        self.started = time.monotonic()
        self.results: dict = {}
        self.data = tmp / "text"
        self.forks = None
        if args.smoke:
            self.forks = multiprocessing.get_context("forkserver")
            self.forks.set_forkserver_preload(["train.train", "torch._dynamo"])  # what every optimizer step imports

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def attempt(self, name: str, kind: str, fn) -> None:
        """fn() into results[name]; an error recorded and printed, a measurement past the budget skipped."""
        if not self.args.smoke and self.left() < ESTIMATE[kind]:
            self.results[name] = {"skipped": f"{self.left():.0f} s left of --budget-s"}
            print(f"{name}: skipped ({self.left():.0f} s left)", flush=True)
            return
        began = time.monotonic()
        try:
            self.results[name] = fn()
        except Exception as error:  # one failure must not lose the rest
            traceback.print_exc()
            self.results[name] = {"error": f"{type(error).__name__}: {error}"[-2000:]}
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # this process's cached blocks: the next trainer's memory
        print(f"{name}: {time.monotonic() - began:.0f} s: {json.dumps(self.results[name])[:300]}", flush=True)
        # What is measured so far survives a run cut short (main writes the whole at the end).
        Path(self.args.json).write_text(json.dumps({"partial": True, "results": self.results}, indent=2))

    def env(self) -> dict:
        env = dict(os.environ, PYTHONPATH=str(REPO / "assets"))
        if self.args.smoke:
            env["OMP_NUM_THREADS"] = "1"  # a shared CPU: spinning intra-op threads only slow tiny steps
        return env

    def train(self, argv: list[str], run: Path, after: int = 0, patch: dict | None = None) -> dict:
        """One trainer process (a resume: of a run at step `after`); its summary's figures and its step
        times. `patch`: run it through patched_trainer (a profile window: its summary is the result)."""
        argv = ["--run-dir", str(run), *argv]
        out = self.tmp / "trainer.json"
        if self.forks is not None:
            self.forked(argv, patch, out)
        else:
            command = [sys.executable, "-m", "train.train", *argv]
            if patch is not None:
                spec = json.dumps({**patch, "argv": argv})
                command = [sys.executable, __file__, "--trainer", spec, "--json", str(out)]
            self.process(command)
        if patch and patch.get("window"):
            return json.loads(out.read_text())
        result = figures(json.loads((run / rundir.SUMMARY).read_text()))
        try:
            result["windows_ms"] = step_windows(run, after, result["steps"])
        except Exception as error:  # the summary's figures stand without them
            result["windows_error"] = f"{type(error).__name__}: {error}"
        return result

    def forked(self, argv: list[str], patch: dict | None, out: Path) -> None:
        """A smoke run's trainer: a process forked from a server that imported torch once (smoke_trainer).
        On a CPU the start-up is not what the smoke run measures, and ten of them were most of its time."""
        log = self.tmp / "trainer.log"
        child = self.forks.Process(target=smoke_trainer, args=(argv, patch, str(out), self.env(), str(log)))
        child.start()
        child.join(timeout=max(60.0, self.left() + 60))
        if child.is_alive():
            child.kill()
            child.join()
        if child.exitcode:
            raise RuntimeError(f"exit {child.exitcode}: {log.read_text()[-1500:]}")

    def peer(self, spec: dict) -> dict:
        """One plain loop (run_peer) in a fresh process: its figures. A smoke run's main measurements run
        them in this process (a CPU has no start-up worth timing; --profile's peer keeps the path tested)."""
        if self.args.smoke and not spec.get("window"):
            return run_peer(spec)
        out = self.tmp / "peer.json"
        out.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--peer", json.dumps(spec), "--json", str(out)]
        if self.args.smoke:
            command.append("--smoke")
        self.process(command)
        return json.loads(out.read_text())

    def process(self, command: list[str], timeout: float | None = None) -> None:
        """A measurement's fresh process; its output's end in the error when it fails or outruns the
        budget (a --compile trainer past it said nothing of how far it got)."""
        try:
            done = subprocess.run(
                command, cwd=REPO, env=self.env(), capture_output=True, text=True,
                timeout=timeout or max(60.0, self.left() + 60),
            )  # fmt: skip
        except subprocess.TimeoutExpired as late:
            parts = (late.stdout, late.stderr)
            said = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or "" for part in parts)
            raise RuntimeError(f"still running after {late.timeout:.0f} s: {said[-1500:]}") from None
        if done.returncode:
            raise RuntimeError(f"exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")

    def text_argv(self, tokens: list[str], attention: str = "auto", pad: int = 8) -> list[str]:
        return [
            "--recipe", "transformer-base", "--data", str(self.data), *self.size["model"], *tokens,
            "--attention", attention, "--pad-multiple", str(pad), "--log-every", "100",
            "--eval-every", "1000000", "--checkpoint-every", "1000000", "--checkpoint-minutes", "0",
            "--eval-samples", "16", "--eval-batch", "16", "--keep-checkpoints", "1",
        ]  # fmt: skip

    def text_runs(self, label: str, tokens: list[str], steps: int) -> None:
        """The trainer, its resume, and the plain loops fed its batches and at its token count."""
        argv, run = self.text_argv(tokens), self.tmp / f"run-{label}"
        self.attempt(f"{label}: trainer", "trainer", lambda: self.train([*argv, "--max-steps", str(steps)], run))
        total = str(steps + self.size["resume"])
        resume = [*argv, "--max-steps", total]
        self.attempt(f"{label}: trainer resumed", "resume", lambda: self.train(resume, run, steps))
        plain = {"argv": argv, "steps": steps}  # the trainer's batches, all its steps: compared step for step
        self.attempt(
            f"{label}: plain, trainer's batches, flash/efficient",
            "plain",
            lambda: self.peer({**plain, "kind": "batches", "backends": "auto"}),
        )
        self.attempt(f"{label}: plain, fixed shape", "plain", lambda: self.peer({**plain, "kind": "fixed"}))

    def cudnn_peer(self, label: str, tokens: list[str], steps: int) -> None:
        spec = {"kind": "batches", "argv": self.text_argv(tokens), "steps": steps, "backends": None}
        self.attempt(f"{label}: plain, trainer's batches, torch SDPA", "plain", lambda: self.peer(spec))

    def resnet_runs(self):
        s = self.size
        common = ["--recipe", "resnet50", *s["resnet"], "--eval-samples", "64"]  # `auto` precision: fp16 on GPUs
        common += ["--eval-batch", "64", "--eval-every", "1000000", "--checkpoint-every", "1000000"]
        steps = ["--max-steps", str(s["r_steps"])]
        self.attempt(
            "resnet50 synthetic: trainer",
            "resnet",
            lambda: self.train([*common, "--synthetic", *steps, "--data", str(self.tmp)], self.tmp / "run-r50"),
        )
        spec = {"kind": "resnet", "batch": s["r_batch"], "size": s["r_size"], "width": s["r_width"]}
        self.attempt("resnet50 synthetic: plain", "plain", lambda: self.peer({**spec, "steps": s["r_steps"] // 2}))

        def jpeg_run(patch: dict | None = None) -> dict:
            root = self.tmp / "jpegs"
            kib = peers.jpegs(root, *s["jpeg"]) if not root.exists() else None
            argv = [*common, *s["j_args"], "--data", str(root), "--max-steps", str(s["j_steps"])]
            return dict(self.train(argv, self.tmp / f"run-jpeg{'-old' if patch else ''}", patch=patch), jpeg_kib=kib)

        self.attempt("resnet50 jpegs: trainer", "jpeg", jpeg_run)
        self.attempt(
            "resnet50 jpegs, decoded as before session 28: trainer", "jpeg", lambda: jpeg_run({"decode": "old"})
        )

    def resnet_bf16(self) -> None:
        """The ResNet trainer in bf16, against its `auto` choice (fp16) above."""
        s = self.size
        argv = ["--recipe", "resnet50", *s["resnet"], "--precision", "bf16", "--synthetic", "--data", str(self.tmp)]
        argv += ["--eval-every", "1000000", "--checkpoint-every", "1000000", "--max-steps", str(s["r_steps"])]
        name = "resnet50 synthetic, --precision bf16: trainer"
        self.attempt(name, "resnet", lambda: self.train(argv, self.tmp / "run-r50-bf16"))

    def variant(self, name: str, attention: str, pad: int, extra: tuple = (), kind: str = "trainer") -> None:
        argv = [*self.text_argv(self.size["budget"], attention, pad), *extra, "--max-steps", str(self.size["steps"])]
        run = self.tmp / f"run-{attention}-{pad}{''.join(extra)}"
        self.attempt(f"budget, {name}: trainer", kind, lambda: self.train(argv, run))

    def patched(self, name: str, patch: dict) -> None:
        """The budget's trainer through patched_trainer (`patch`), for an A/B against the budget's own row."""
        argv = [*self.text_argv(self.size["budget"]), "--max-steps", str(self.size["steps"])]
        self.attempt(
            f"budget, {name}: trainer", "trainer", lambda: self.train(argv, self.tmp / "run-patched", patch=patch)
        )

    def profiles(self) -> None:
        """--profile: the trainer, the plain loop on its batches and at one fixed shape, the same steps under
        torch.profiler."""
        first, last = self.size["profile"]
        self.results["data"] = {"vocab": peers.text_data(self.data, self.size["vocab"], self.size["pairs"])}
        argv = [*self.text_argv(self.size["budget"]), "--max-steps", str(last)]
        spec = {"kind": "batches", "argv": argv, "steps": last, "backends": "auto", "window": [first, last]}
        profiled = {"window": [first, last]}
        run = self.tmp / "run-profiled"
        self.attempt("budget: trainer, profiled", "trainer", lambda: self.train(argv, run, patch=profiled))
        self.attempt("budget: plain, trainer's batches, profiled", "plain", lambda: self.peer(spec))
        # The same operators at one shape and no masks ran 29 ms where the trainer's batches took 45 (session 23).
        fixed = {**spec, "kind": "fixed"}
        self.attempt("budget: plain, fixed shape, profiled", "plain", lambda: self.peer(fixed))

    def reservations(self) -> None:
        """The budget's trainer with the snapshot writer's host buffers three ways, alternated: none reserved
        after step 1, pageable (as it trains since session 23) and page-locked (as before), all through
        patched_trainer. Session 23 on an H100, on the same steps: 1.05x the plain loop without them,
        1.28x with them page-locked (one run each)."""
        argv = [*self.text_argv(self.size["budget"]), "--max-steps", str(self.size["steps"])]
        ways = (
            ("no host-buffer reservation", False),
            ("host buffers pageable", "pageable"),
            ("host buffers page-locked", "locked"),
            ("host buffers pageable, again", "pageable"),
        )
        for number, (name, reserve) in enumerate(ways):
            run, patch = self.tmp / f"run-reserve-{number}", {"reserve": reserve}
            self.attempt(f"budget, {name}: trainer", "trainer", lambda r=run, p=patch: self.train(argv, r, patch=p))

    def run(self) -> None:
        """In order of importance: what the issue's bounds need first."""
        s = self.size
        try:
            self.results["data"] = {"vocab": peers.text_data(self.data, s["vocab"], s["pairs"]), "pairs": s["pairs"]}
        except Exception:
            traceback.print_exc()
        self.text_runs("budget", s["budget"], s["steps"])
        big = ["--max-tokens", str(s["big"])]
        self.text_runs("16k", big, s["big_steps"])
        self.variant("--warm-shapes 0", "auto", 8, ("--warm-shapes", "0"))  # the warm-up's effect, this run
        self.patched("flags by assignment (before session 28)", {"flags": "assigned"})
        self.resnet_runs()
        # Lengths to a multiple of 4: 10.2% padded tokens (close to the issue's 10%) against 8's 21.1%, and 107
        # shapes an epoch against 42 on these lengths (session 27), all warmed: which trains more pairs a second?
        self.variant("--pad-multiple 4", "auto", 4, ("--warm-shapes", "128"))
        self.variant("--attention torch", "torch", 8)
        self.variant("--pad-multiple 1", "auto", 1)
        self.cudnn_peer("budget", s["budget"], s["steps"])
        self.cudnn_peer("16k", big, s["big_steps"])
        # Session 27: the alternated rows did not separate (8% between two runs of one setting); last.
        self.attempt("launch contention", "contention", lambda: self.peer({"kind": "contention"}))
        self.reservations()
        self.resnet_bf16()
        if not self.args.smoke:  # a CPU compiles the model for minutes
            self.variant("--compile", "auto", 8, ("--compile",), "compile")  # start-up: over 144 s on an H100


def run_peer(spec: dict) -> dict:
    """One plain loop in this process (a fresh one: bench_gpu.py --peer)."""
    if spec["kind"] == "resnet":
        return peers.plain_resnet(spec["batch"], spec["size"], spec["width"], spec["steps"])
    if spec["kind"] == "contention":
        from train.config import build_parser, config_from_args
        from train.model import Transformer

        config = config_from_args(build_parser("").parse_args(["--recipe", "transformer-base", "--run-dir", "x"]))
        return peers.launch_contention(peers.state_specs(Transformer(config.model, 8000)))
    batches, model_args = trainer_batches(spec["argv"], spec["steps"])
    window = peers.ProfileWindow(*spec["window"]) if spec.get("window") else None
    if spec["kind"] == "fixed":
        tokens = sum((b[0].numel() + b[2].numel()) / 2 for b in batches) / len(batches)
        one = peers.fixed_batches(model_args["vocab"], int(tokens))
        return dict(peers.plain_transformer(model_args, one, spec["steps"], False, None, window), tokens=tokens)
    return peers.plain_transformer(model_args, batches, spec["steps"], True, pinned(spec["backends"]), window)


def patched_trainer(spec: dict) -> dict:
    """The trainer in this process (bench_gpu.py --trainer SPEC) on spec["argv"]. "window": [first, last]
    profiles those steps (their summary is the result); "reserve": false leaves out the snapshot writer's
    host-buffer reservation after step 1 (the buffers are then allocated at the first snapshot or
    checkpoint, on the training thread), "pageable" as the trainer does, "locked" page-locks them
    (StateWriter(lock=True): the trainer's way until session 23)."""
    from train import distributed, snapshot, train, trainer

    window = peers.ProfileWindow(*spec["window"]) if spec.get("window") else None
    if window is not None:
        plain_step, count = trainer.Trainer.train_step, [0]

        def train_step(self):
            count[0] += 1
            return window.around(count[0], lambda: plain_step(self))

        trainer.Trainer.train_step = train_step  # type: ignore[method-assign]
    if spec.get("reserve") is False:
        trainer.Trainer._reserve = lambda self: None  # type: ignore[method-assign]
    lock = {"locked": True, "pageable": False}.get(spec.get("reserve"))
    if lock is not None:
        made = snapshot.StateWriter.__init__

        def writer(self, device, lock=lock):
            made(self, device, lock)

        snapshot.StateWriter.__init__ = writer  # type: ignore[method-assign]
    if spec.get("flags") == "assigned":
        distributed.to_device = _flags_by_assignment
    if spec.get("decode") == "old":
        import bench_decode

        from train import imagepipe

        imagepipe.Samples.__getitems__ = None  # type: ignore[assignment,method-assign]  # DataLoader: per sample
        imagepipe.Samples.__getitem__ = bench_decode.OldSamples.__getitem__  # type: ignore[method-assign]
        imagepipe.collate = bench_decode.old_collate
    if train.main(spec["argv"]):
        raise SystemExit("the trainer failed")
    return window.summary if window is not None else {}


def _flags_by_assignment(values: list[float], device) -> "torch.Tensor":
    """The step's flags as the trainer set them before session 28: element by element, each assignment a
    host scalar copied with a wait for the stream on a GPU (pytorch/pytorch#188267)."""
    counts = torch.zeros(len(values), device=device)
    for index, value in enumerate(values[1:], 1):
        counts[index] = value
    return counts


def smoke_trainer(argv: list[str], patch: dict | None, out: str, env: dict, log: str) -> None:
    """Bench.forked's child: `python -m train.train ARGV` (or --trainer's patched_trainer) as a fresh process
    would run it: its environment, working directory, output (into `log`) and exit."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    multiprocessing.set_start_method(None, force=True)  # a forkserver's child inherits "forkserver": the default
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))  # the server read it at import
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from train import distributed, train

    if patch is None:
        distributed.exit_without_finalizing(train.main(argv))
    Path(out).write_text(json.dumps(patched_trainer({**patch, "argv": argv})))
    distributed.exit_without_finalizing(0)


def pinned(choice: str | None):
    from train.perf import attention_backends

    return attention_backends(choice) if choice and torch.cuda.is_available() else None


def trainer_batches(argv: list[str], steps: int) -> tuple[list, dict]:
    """The trainer's own first `steps` batches (the same sampler from the same flags) on the device,
    and the plain model's sizes."""
    from train.config import build_parser, config_from_args
    from train.distributed import DistInfo
    from train.recipes import TranslationTask

    config = config_from_args(build_parser("").parse_args([*argv, "--run-dir", "unused"]))
    task = TranslationTask(config, DistInfo(), torch.device("cpu"))
    dev = peers.device()
    batches = [tuple(t.to(dev) for t in task._host_batches(step)[0]) for step in range(steps)]
    m = config.model
    return batches, dict(vocab=task.vocab, d_model=m.d_model, heads=m.heads, layers=m.layers, ffn=m.ffn)


def step_windows(run: Path, first: int, last: int) -> list[float]:
    """The trainer's step times (its TensorBoard scalars) from step first + 1 to last, as window means
    in ms, step first + 1 on its own first (the process's start-up)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / rundir.TENSORBOARD), size_guidance={"scalars": 0}).Reload()
    times = {e.step: e.value for e in events.Scalars("perf/step_time_s") if first < e.step <= last}
    ordered = [times[step] for step in sorted(times)]
    return [round(1000 * ordered[0], 1), *peers.window_means(ordered)] if ordered else []


def figures(summary: dict) -> dict:
    warmup, parts, shapes = summary["warmup"], summary["breakdown"], summary.get("batch_shapes") or {}
    step = summary["avg_step_time_s"]
    return {
        "steady_step_s": step,
        "settled": warmup["settled"],
        "warmup_steps": warmup["warmup_steps"],
        "warmup_s": warmup["warmup_s"],
        "first_50_mean_s": warmup["first_50_mean_s"],
        "first_step_s": warmup.get("first_step_s"),
        "shapes_warmed": warmup.get("shapes_warmed"),
        "shape_warm_s": warmup.get("shape_warm_s"),
        "data_wait": parts.get("data_s", 0.0) / step if step else None,
        "flops_per_step": summary.get("flops_per_step"),
        "mfu": summary.get("mfu"),
        "distinct_shapes": shapes.get("distinct_shapes"),
        "padded_fraction": shapes.get("padded_fraction"),
        "steps": summary["steps"],
        "objects_per_s": summary.get("objects_per_s"),  # sentence pairs: across paddings, not the step time
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the default without a GPU)")
    parser.add_argument(
        "--budget-s", type=float, default=330.0, help="skip what would run past this (the table prints after)"
    )
    parser.add_argument("--profile", action="store_true", help="only the trainer and its plain peer, profiled")
    parser.add_argument("--peer", help=argparse.SUPPRESS)  # one plain loop, in a fresh process (Bench.peer)
    parser.add_argument("--trainer", help=argparse.SUPPRESS)  # the trainer, patched (Bench.train)
    args = parser.parse_args()
    if args.peer or args.trainer:
        if args.smoke:
            torch.set_num_threads(1)
        spec = json.loads(args.peer or args.trainer)
        Path(args.json).write_text(json.dumps(run_peer(spec) if args.peer else patched_trainer(spec)))
        return
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: the smoke sizes", flush=True)
        args.smoke = True
    if args.smoke:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        machine = gpu_report.machine()
        print(json.dumps(machine), flush=True)
        bench.profiles() if args.profile else bench.run()
    out: dict = {"machine": machine, "smoke": args.smoke, "elapsed_s": time.monotonic() - bench.started}
    if args.profile:
        print(gpu_report.profiles(bench.results))
    else:
        out["checks"] = gpu_report.checks(bench.results)
        print(gpu_report.table(bench.results, machine))
        print(gpu_report.details(bench.results))
        print(gpu_report.checks_text(out["checks"]))
    Path(args.json).write_text(json.dumps({**out, "results": bench.results}, indent=2))
    print(f"wrote {args.json} ({out['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
