"""The DDP training loop: exact global-batch semantics, AMP, gradient compression, eval, checkpoints."""

from __future__ import annotations

import contextlib
import re
import signal
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from cluster_node.protocol import rundir
from cluster_node.protocol.spec import sized_by_tokens
from cluster_node.tools import duration
from train import autocompress, breakdown, checkpoint, commhooks, distributed, perf, snapshot
from train.callbacks import Callback, start_wandb
from train.config import ConfigError, TrainConfig, resolve_precision

# RUN_DIR/STOP (`fab stop`, the Spot watcher's) ends the run with a checkpoint at the next step, no eval; a
# STOP whose first word is rundir.URGENT_STOP_WORD (a Spot notice) is also voted urgent (self.urgent_stop).


def _urgent(stop_file: Path) -> bool:
    try:
        # Any line: a Spot watcher appends its `now: spot: ...` after a `fab stop` already there.
        return re.search(rf"^\s*{rundir.URGENT_STOP_WORD}\b", stop_file.read_text(), re.M) is not None
    except OSError:  # removed meanwhile
        return False


def _seed_step(seed: int, device: torch.device) -> None:
    """The generators a step draws from (dropout: the rank's device's; the CPU's), seeded as torch.manual_seed
    seeds them, without its calls into every other backend (~130 us a step here: MTIA and XPU, and CUDA on
    a CPU, each format a stack for a lazy call). By the device's index, whichever device is current."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)


def _say(line: str) -> None:
    """A line from any rank (the node's own snapshot writer, which rank 0's log would not show)."""
    print(line, flush=True)


class Trainer:
    """The loop around a recipe's task. train.py composes it: the task (model, batches, loss, eval), the
    optimizer, the LR schedule and the callbacks are built there and handed in."""

    def __init__(
        self,
        config: TrainConfig,
        info: distributed.DistInfo,
        device: torch.device,
        task,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        callbacks: Sequence[Callback] = (),
    ):
        self.config, self.info, self.device = config, info, device
        self.run_dir = Path(config.run_dir)
        self.task, self.model = task, task.model
        self.optimizer, self.scheduler, self.callbacks = optimizer, scheduler, list(callbacks)
        for note in getattr(self.task, "notes", []):
            self.log(note)
        resolve_precision(config, device)  # `auto` (train.py resolves it first, to print why)
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
        self.step = 0
        self.best = float("-inf")
        self.resumed_from = None
        self.stop_requested = False
        self.urgent_stop = False
        self.checkpoint_due = False  # rank 0's time bound, agreed through the step's flag all-reduce
        self.fit_started = time.time()
        self.last_save = self.last_snapshot = time.monotonic()
        self.snapshot_due = False  # rank 0's clock, agreed like checkpoint_due: every node snapshots one step
        # Every rank reads its node's snapshot at a resume; local rank 0 writes it.
        self.snapshot_source = snapshot.snapshot_dir(self.run_dir) if config.snapshot_seconds > 0 else None
        self.snapshot_target = self.snapshot_source if info.local_rank == 0 else None
        writes = info.is_main or self.snapshot_target is not None
        self.state_writer = snapshot.StateWriter(device) if writes else None
        self._resume()
        self.shapes_warmed = self._warm_shapes()  # before the calibration and DDP: they time steady steps
        self.timer = breakdown.StepTimer(breakdown.clock_for(device))
        self.wire = breakdown.AllReduceCounter()
        self.step_parts: list[dict] = []  # this process's steps, resolved at log intervals
        self.bucket_cap_mb = config.bucket_cap_mb
        self.ddp: Optional[DDP] = None
        self.calibration: Optional[dict] = None
        self.auto_compression: Optional[dict] = None
        if info.world_size > 1:
            self._distribute()
        module = self.ddp or self.model
        self.step_module = perf.compiled(module, getattr(task, "varied_shapes", False)) if config.compile else module
        self.clock = time.perf_counter  # step times (tests script it)
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        self.writer = self.wandb = None
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / rundir.TENSORBOARD))
            self.wandb = start_wandb(config, self.run_dir, self.log)
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _warm_shapes(self) -> dict:
        """The task's commonest batch shapes, each run once (perf.warm_shapes): {shapes, seconds}."""
        if self.step >= self.config.max_steps:  # nothing to train
            return {}
        count = perf.shapes_to_warm(self.config.warm_shapes, self.device.type)
        shape_batches = getattr(self.task, "shape_batches", None)
        batches = shape_batches(self.step, count) if shape_batches is not None else []
        if not batches:
            return {}
        start, wall = time.perf_counter(), time.time()
        perf.warm_shapes(self.model, batches, self.task.loss_sum, self.device, self.amp_dtype, self.config.attention)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self._interval("warm_shapes", wall)  # goodput's warm-up, not start-up
        self.log(f"warmed {len(batches)} batch shapes in {seconds:.1f} s (each run once before step {self.step + 1})")
        return {"shapes_warmed": len(batches), "shape_warm_s": seconds}

    def _distribute(self) -> None:
        """Calibrate (and choose the --grad-compression auto mode), then wrap the model in DDP with the
        mode's comm hook (commhooks.py) and count the all-reduced bytes."""
        config, device = self.config, self.device
        self.calibration, self.auto_compression = autocompress.start_of_run(self)
        if self.auto_compression:
            self.log(f"--grad-compression auto: {config.grad_compression}: {self.auto_compression['why']}")
        device_ids = [device] if device.type == "cuda" else None
        self.ddp = ddp = DDP(self.model, device_ids=device_ids, bucket_cap_mb=config.bucket_cap_mb)
        commhooks.register(ddp, config, self.timer)
        self.wire.install()

    def log(self, message: str) -> None:
        if self.info.is_main:
            print(message, flush=True)

    def scalars(self, values: dict, step: int | None = None) -> None:
        """Rank 0: to TensorBoard, and to W&B when configured (at this step unless given)."""
        step = self.step if step is None else step
        for key, value in values.items():
            if value is not None and self.writer:
                self.writer.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log({k: v for k, v in values.items() if v is not None}, step=step)

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    def _resume(self) -> None:
        state = checkpoint.load_agreed(
            self.run_dir,
            self.info.is_main,
            distributed.broadcast_from_main,
            log=self.log,
            snapshot=self.snapshot_source,
            gather=distributed.all_gather_objects,
        )
        if state is None:
            self.log(f"starting a new run in {self.run_dir}")
            if not (self.run_dir / rundir.CONFIG).exists():  # a new run: a namesake's snapshots are not its own
                checkpoint.drop_snapshots(self.snapshot_target)
            return
        _refuse_another_global_batch(state, self.config, self.info.world_size)
        self.model.load_state_dict(state["model"])
        # The optimizer's implementation is this machine's (fused on a GPU), whatever saved the state.
        for saved, mine in zip(state["optimizer"]["param_groups"], self.optimizer.param_groups):
            saved.update({k: mine[k] for k in ("fused", "foreach", "capturable") if k in mine})
        # On a CPU the optimizer keeps what it is given: views of the file's one block per dtype
        # (snapshot.HostBlock) would keep the whole file in memory, a /dev/shm snapshot's pages too.
        optimizer = state["optimizer"] if self.device.type == "cuda" else snapshot.owned(state["optimizer"])
        self.optimizer.load_state_dict(optimizer)
        checkpoint.settle_optimizer_state(self.optimizer)  # the parameters' layouts, SGD's buffers
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.best = state.get("best", float("-inf"))
        self.resumed_from = state["path"]
        held = self.snapshot_source is not None and Path(state["path"]).parent == self.snapshot_source
        kind = "this node's snapshot " if held else ""
        self.log(f"resuming from {kind}{state['path']} at step {self.step}")

    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
            "best": self.best,
            "config": self.config.to_dict(),
            "rng": {"torch": torch.get_rng_state(), "world_size": self.info.world_size},
            **self.task.checkpoint_extras(),
        }

    def save(self, best: bool = False) -> None:
        self.persist(True, best)

    def persist(self, checkpoint_now: bool, best: bool = False) -> None:
        """The checkpoint (rank 0) and this node's snapshot (when due, local rank 0 of each node): the loop
        only copies the state (snapshot.StateWriter); the files are written behind it. The `checkpoint`
        phase is the loop's stall."""
        writes = []
        if checkpoint_now and self.info.is_main:
            writes.append(checkpoint.persist(self.run_dir, self.step, self.config.keep_checkpoints, best, self.log))
        if self.snapshot_due and self.snapshot_target is not None:
            # A snapshot newer than every heartbeat is taken for an older run's by the restart plan.
            if not all(callback.flush() for callback in self.callbacks):
                _say(f"warning: heartbeat not written before the snapshot at step {self.step}: a restart may skip it")
            writes.append(checkpoint.persist_snapshot(self.snapshot_target, self.run_dir, self.step, _say))
        if writes:
            assert self.state_writer is not None
            start = time.time()
            self.state_writer.submit(self._state(), writes)
            if checkpoint_now and self.info.is_main:
                self._interval("checkpoint", start)
            elif self.info.is_main:  # the snapshot's copy: where a resume from it starts, and its stall
                self._interval("snapshot", start)
        now = time.monotonic()
        if checkpoint_now:
            self.last_save = now
        if self.snapshot_due:
            self.last_snapshot = now

    def flush_writes(self) -> None:
        """Every write taken is durable: before STOP's and the end's records say so."""
        if self.state_writer is not None:
            self.state_writer.flush()

    def _reserve(self) -> None:
        """After the first step (the optimizer's state exists): the writer's host buffers, and this node's
        check that a snapshot fits in its memory (a one-line warning turns them off here)."""
        if self.state_writer is None:
            return
        state = self._state()
        if self.snapshot_target is not None:
            size = snapshot.nbytes(state)
            refusal = snapshot.memory_refusal(size, self.snapshot_target)
            if refusal:
                print(f"warning: {refusal}", flush=True)
                self.snapshot_target = None
                if not self.info.is_main:  # no checkpoints to write either: no buffers
                    self.state_writer.close()
                    self.state_writer = None
                    return
            elif self.info.is_main:
                every = self.config.snapshot_seconds
                self.log(f"snapshots every {every:g} s to {self.snapshot_target} ({size / 1e6:.0f} MB)")
        self.state_writer.reserve(state)

    def _snapshot_bound(self) -> bool:
        """Rank 0: this node's snapshot is older than --snapshot-seconds."""
        seconds = self.config.snapshot_seconds
        return self.info.is_main and seconds > 0 and time.monotonic() - self.last_snapshot >= seconds

    def _time_bound(self) -> bool:
        """Rank 0: the newest checkpoint is older than --checkpoint-minutes."""
        minutes = self.config.checkpoint_minutes
        return self.info.is_main and minutes > 0 and time.monotonic() - self.last_save >= minutes * 60

    def _interval(self, event: str, start: float) -> None:
        for callback in self.callbacks:
            callback.on_interval(event, start, time.time(), self.step)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """One optimizer step with no host synchronisation of its own: the units and stop-flag sum
        (one tiny all-reduce) runs during the first forward, the flags are read after the step's
        work is queued, the loss stays on the device. Returns (this rank's loss sum, the global units, stop agreed by
        all ranks); the loss stays on the device until a log step reads it (_flush_losses)."""
        c = self.config
        _seed_step(c.seed * 7919 + self.step * self.info.world_size + self.info.rank, self.device)
        self.timer.begin()
        batches = self.task.batches(self.step)
        self.timer.mark("data")
        stop, urgent = self.stop_requested, False
        stop_file = self.run_dir / rundir.STOP
        if self.info.is_main and stop_file.exists():
            stop, urgent = True, _urgent(stop_file)
        # units (exact below 2**24), stop, stop without eval, checkpoint due, snapshot due (rank 0 decides each flag)
        local = [0.0, float(stop), float(urgent), float(self._time_bound()), float(self._snapshot_bound())]
        counts = distributed.to_device(local, self.device)
        for batch in batches:
            counts[0] += self.task.units(batch)
        # Summed while the first forward runs; waited for only where the loss needs the global units.
        wait_counts = distributed.start_all_reduce_sum(counts)
        flags = None
        units = counts[0]
        module = self.step_module
        if not self.model.training:  # after an eval: the call walks every module (~0.4 ms a step)
            self.model.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.timer.current["flops"] = sum(self.task.flops(batch) for batch in batches)
        self.timer.mark("forward")
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            context = self.ddp.no_sync() if (self.ddp is not None and not last) else contextlib.nullcontext()
            autocast = torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)
            with context, perf.attention_context(c.attention, self.device.type), autocast:
                loss_sum = self.task.loss_sum(module, batch)
                if flags is None:
                    wait_counts()
                    flags = distributed.HostCopy(counts, local if self.info.world_size == 1 else None)
                # DDP averages over ranks; scaling by world/units makes it the global mean per unit.
                loss = loss_sum * self.info.world_size / units
            self.wire.armed = last
            self.scaler.scale(loss).backward()  # SDPA's backward: the kernel its forward chose
            self.wire.armed = False
            total += loss_sum.detach()
        self.timer.mark("backward")
        self.scaler.unscale_(self.optimizer)
        if c.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.timer.mark("optimizer")
        self.step += 1
        self.timer.current["payload_bytes"] = self.wire.take()
        self.timer.end()
        assert flags is not None, "a step has at least one micro-batch"
        _, stop_votes, urgent_votes, due_votes, snapshot_votes = flags.values()
        self.urgent_stop, self.checkpoint_due, self.snapshot_due = urgent_votes > 0, due_votes > 0, snapshot_votes > 0
        return total, units, stop_votes > 0

    def _flush_losses(self, pending: list) -> float | None:
        """The global loss per unit of each pending (step, loss sum, units): one all-reduce and one
        read for them all, each to TensorBoard at its step. Returns the newest; all ranks call it."""
        if not pending:
            return None
        sums = distributed.all_reduce_sum(torch.stack([loss_sum for _, loss_sum, _ in pending]))
        losses = (sums / torch.stack([units for _, _, units in pending])).tolist()
        for (step, _, _), loss in zip(pending, losses):
            self.scalars({"train/loss": loss}, step)
        pending.clear()
        return losses[-1]

    def _progress(self, **values) -> None:
        for callback in self.callbacks:
            callback.on_progress(self.step, values)

    def fit(self) -> dict:
        """Train to max_steps, a STOP or the target metric; summary.json's values."""
        c, metric = self.config, self.task.metric
        global_batch = c.global_batch(self.info.world_size)
        step_times: list[float] = []
        pending: list = []  # (step, loss sum on the device, units) not yet read
        last_eval: dict = {}
        ended, ended_by = "max_steps", rundir.EndedBy.STEPS
        started = self.fit_started = time.time()
        if self.step >= c.max_steps:
            self.log(f"run already at step {self.step} >= max steps {c.max_steps}")
        while self.step < c.max_steps:
            tick = self.clock()
            loss_sum, units, stop = self.train_step()
            for callback in self.callbacks:
                callback.on_step(self.step)
            step_times.append(self.clock() - tick)
            pending.append((self.step, loss_sum, units))
            self._log_step(pending, step_times, global_batch)
            if len(step_times) == 1:
                self._reserve()
            reached = False
            if stop:  # fab stop or a Spot notice: a checkpoint now, no eval (one may outlast fab stop's wait)
                self.save()
                self.flush_writes()  # durable before the trainer exits, the urgent one too
            elif self.step % c.eval_every == 0 or self.step == c.max_steps or stop:
                last_eval = self.run_eval()
                score = last_eval.get(metric)
                improved = score is not None and score > self.best
                self.best = max(self.best, score) if score is not None else self.best
                reached = c.target_metric is not None and score is not None and score >= c.target_metric
                self.save(best=improved)
            else:
                self.persist(self.step % c.checkpoint_every == 0 or self.checkpoint_due)
            if stop:
                ended, ended_by = "stop requested (checkpoint now, no eval)", rundir.EndedBy.STOP
                if self.info.is_main:
                    (self.run_dir / rundir.STOP).unlink(missing_ok=True)
                break
            if reached:
                ended, ended_by = f"target {metric} {c.target_metric} reached", rundir.EndedBy.TARGET
                break
        self.flush_writes()  # the end's records (the log line, summary.json, progress.json) after it
        self._flush_losses(pending)
        self.log(f"run ended at step {self.step}: {ended}")
        wall = time.time() - started
        summary = self._summary(step_times, global_batch, last_eval, (ended, ended_by), wall).to_json()
        if step_times and self.snapshot_target is not None:
            # The run ended at a checkpoint as new (rank 0 flushed it before the summary's gather): the
            # snapshot would hold the node's memory for nothing.
            checkpoint.drop_snapshots(self.snapshot_target)
        return summary

    def _log_step(self, pending: list, step_times: list[float], global_batch: int) -> None:
        """Per step: LR and timing; at log steps also the losses so far, memory and the log line."""
        c = self.config
        lr, last = self.scheduler.get_last_lr()[0], step_times[-1]
        self.scalars({"train/lr": lr, "perf/step_time_s": last, "perf/objects_per_s": global_batch / last})
        if self.step % c.log_every == 0 or self.step == 1:
            recent = step_times[1:][-c.log_every :] or step_times  # the first step is start-up, not speed
            step_time = sum(recent) / len(recent)
            loss = self._flush_losses(pending)
            parts = self._interval_breakdown()
            self.scalars(
                {"perf/memory_mb": breakdown.memory_mb(self.device), **{f"breakdown/{k}": parts[k] for k in parts}}
            )
            elapsed = time.time() - self.fit_started
            if len(step_times) == 1 and c.max_steps > 1:  # its speed, parts and ETA would mislead
                self.log(first_step_line(self.step, c.max_steps, c.log_every, loss, lr, step_time))
                self._progress(loss=loss, elapsed_s=elapsed)
                return
            eta = (c.max_steps - self.step) * step_time
            self.log(
                f"step {self.step}/{c.max_steps} ({100 * self.step // c.max_steps}%) | loss {loss:.3f} | lr "
                f"{lr:.2e} | {step_time * 1000:.0f} ms/step | "
                f"{global_batch / step_time:.0f} objects/s{perf.flops_text(parts, self.device_name)} | "
                f"slowest rank: {breakdown.parts_line(parts)} | "
                f"elapsed {duration(elapsed)} | ETA {duration(eta)}"
            )
            self._progress(loss=loss, avg_step_time_s=step_time, breakdown=parts, elapsed_s=elapsed, eta_s=eta)

    def _interval_breakdown(self) -> dict:
        """The critical rank's mean parts over the steps since the last call (all ranks call it: one
        gather per logging interval)."""
        steps = self.timer.resolve()
        self.step_parts.extend(steps)
        per_rank = distributed.all_gather_objects(breakdown.mean_parts(steps))
        return per_rank[breakdown.critical_rank(per_rank)]

    def _summary_breakdown(self, timed_steps: int) -> dict:
        """summary.json "breakdown": the critical rank's means over the timed steps, with every rank's."""
        self.step_parts.extend(self.timer.resolve())
        window = self.step_parts[len(self.step_parts) - timed_steps :] if timed_steps else []
        per_rank = distributed.all_gather_objects(breakdown.mean_parts(window))
        critical = breakdown.critical_rank(per_rank)
        result = dict(per_rank[critical])
        world = self.info.world_size
        result.update(
            wire_bytes=breakdown.ring_wire_bytes(result.get("payload_bytes", 0.0), world),
            grad_bytes=sum(4 * p.numel() for p in self.model.parameters() if p.requires_grad),
            single_bucket=world > 1 and round(result.get("buckets", 0)) == 1,
            bucket_cap_mb=self.bucket_cap_mb,
            critical_rank=critical,
            per_rank=per_rank,
        )
        return result

    def run_eval(self) -> dict:
        start = time.time()
        self.log(f"evaluating at step {self.step} (up to {self.config.eval_samples} samples) ...")  # a long wait
        result = self.task.evaluate()
        texts = {k: result.pop(k) for k in list(result) if isinstance(result[k], list)}
        if self.info.is_main:
            (eval_dir := self.run_dir / rundir.EVAL).mkdir(exist_ok=True)
            for kind, lines in texts.items():  # translation: hypotheses, references, sources
                text = "".join(line + "\n" for line in lines)
                rundir.write_bytes(eval_dir / rundir.EVAL_TEXT.format(step=self.step, kind=kind), text.encode())
            measured = {k: v for k, v in result.items() if v is not None}  # synthetic data: nothing
            if measured:
                self.log(
                    f"eval step {self.step} | "
                    + " | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in measured.items())
                )
            self.scalars({f"eval/{k}": v for k, v in result.items()})
        self._interval("eval", start)
        return result

    def _summary(self, step_times, global_batch, last_eval, end: tuple[str, rundir.EndedBy], wall) -> rundir.Summary:
        warmup = {**perf.steady_state(step_times), **self.shapes_warmed}  # the averages are the steady steps'
        avg = warmup["steady_step_s"]
        parts = self._summary_breakdown(warmup["steady_steps"])
        flops = sum(rank.get("flops", 0.0) for rank in parts["per_rank"])  # every rank's micro-batches
        peak = perf.peak_tflops(self.device_name)
        shapes = getattr(self.task, "shapes", None)
        steps = checkpoint.list_steps(self.run_dir)
        ended, ended_by = end
        # The measurements and the task's metrics beside the record's keys: its `extra`.
        extra = {
            "warmup": warmup,
            "flops_per_step": flops,
            "mfu": perf.mfu(flops, avg, peak, self.info.world_size),
            "mfu_peak": {"device": self.device_name, "tflops": peak},
            "batch_shapes": shapes.summary() if shapes is not None else None,
            **last_eval,
            f"best_{self.task.metric}": self.best if self.best > float("-inf") else None,
        }
        summary = rundir.Summary(
            recipe=self.config.recipe,
            steps=self.step,
            world_size=self.info.world_size,
            global_batch=global_batch,
            objects=self.task.objects,
            avg_step_time_s=avg,
            objects_per_s=global_batch / avg if avg else 0.0,
            checkpoint_mb=checkpoint.size_mb(steps[-1]) if steps else None,
            precision=self.config.precision,
            grad_compression=self.config.grad_compression,
            resumed_from=self.resumed_from,
            ended=ended,
            ended_by=ended_by,
            wall_time_s=wall,
            breakdown=parts,
            calibration=self.calibration,
            auto_compression=self.auto_compression,
            extra=extra,
        )
        if self.info.is_main and (step_times or not (self.run_dir / rundir.SUMMARY).exists()):
            rundir.write_record(self.run_dir / rundir.SUMMARY, summary, indent=2)  # never zeros over a result
        # after the summary, as readers expect
        self._progress(loss=None, avg_step_time_s=avg, ended=ended, ended_by=ended_by)
        if self.info.is_main:
            if self.writer:
                self.writer.close()
            if self.wandb:
                self.wandb.finish()
        return summary


# ---------------------------------------------------------------- the step lines rank 0 logs


def first_step_line(step: int, max_steps: int, log_every: int, loss: Any, lr: Any, seconds: float) -> str:
    """The log line of a run's first step: its time is start-up (allocation, the first collectives), and
    its parts may exceed it (the slowest rank's): no speed, breakdown or ETA from it."""
    later = min(max(log_every, step + 1), max_steps)
    return (
        f"step {step}/{max_steps} ({100 * step // max_steps}%) | loss {loss:.3f} | lr {lr:.2e} | first step "
        f"{seconds * 1000:.0f} ms "
        f"(start-up; speed and ETA from step {later})"
    )


def _refuse_another_global_batch(state: dict, config: TrainConfig, world_size: int) -> None:
    """A checkpoint resumes at the global batch it was trained at: the learning rate (ResNet's scales with it),
    the sample stream's position and the steps left all count it; a --max-tokens run's step is its ranks x
    accumulation x token budget (sized_by_tokens). On another number of ranks the launch must keep it with
    --batch-per-gpu and --grad-accum (`fab train` does: resume.keep_global_batch)."""
    saved, ranks = state.get("config") or {}, (state.get("rng") or {}).get("world_size")
    if not ranks or "batch_per_gpu" not in saved:
        return  # a checkpoint from before its settings were kept in it
    mine = config.to_dict()
    before, now = _step_size(saved, ranks), _step_size(mine, world_size)
    if before != now:
        raise ConfigError(
            f"{state['path']} was trained at a global batch of {before[0]}{before[1]} (ranks x batch x accumulation: "
            f"{ranks} x {saved['batch_per_gpu']} x {saved.get('grad_accum', 1)}), this launch's is {now[0]}{now[1]} "
            f"({world_size} x {config.batch_per_gpu} x {config.grad_accum}): resume it with --batch-per-gpu and "
            f"--grad-accum that keep it on {world_size} ranks (and --keep-global-batch {before[0]}), or a new --run"
        )


def _step_size(config: dict, world_size: int) -> tuple[int, str]:
    """(objects a step takes, and for a token-sized run the tokens it takes, as words)."""
    accum = config.get("grad_accum", 1)
    tokens = f", {config['max_tokens'] * world_size * accum} tokens" if sized_by_tokens(config) else ""
    return config["batch_per_gpu"] * world_size * accum, tokens
