"""The DDP training loop: exact global-batch semantics, AMP, gradient compression, eval, checkpoints."""
from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import distributed
from config import TrainConfig
from data import DataSet, PAD, atomic_write_bytes, global_batch_indices, rank_slice
from evaluate import evaluate
from model import Transformer


def transformer_lr(step: int, d_model: int, warmup: int, scale: float) -> float:
    """scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def compress_hook(dtype: torch.dtype):
    """A DDP comm hook that all-reduces gradients in `dtype` (fp16/bf16), on NCCL and on gloo
    (PyTorch's own bf16 hook insists on NCCL)."""
    import torch.distributed as dist

    def hook(state, bucket):
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(compressed, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer
        return future.then(decompress)
    return hook


def _register_compression(ddp: DDP, config: TrainConfig) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    if config.grad_compression in ("fp16", "bf16"):
        dtype = torch.float16 if config.grad_compression == "fp16" else torch.bfloat16
        ddp.register_comm_hook(None, compress_hook(dtype))
    elif config.grad_compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


class Trainer:

    def __init__(self, config: TrainConfig, info: distributed.DistInfo, device: torch.device):
        self.config, self.info, self.device = config, info, device
        self.run_dir = Path(config.run_dir)
        self.data = DataSet(config.data, config.model.max_len)
        torch.manual_seed(config.seed)  # the same initial weights for any world size
        self.model = Transformer(config.model, self.data.tokenizer.vocab_size).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1.0,
                                          betas=tuple(config.adam_betas), eps=config.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: transformer_lr(s + 1, config.model.d_model,
                                                     config.warmup_steps, config.lr_scale))
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
        self.step = 0
        self.best_bleu = -1.0
        self.resumed_from = None
        self.stop_requested = False
        self._resume()
        self.ddp = None
        if info.world_size > 1:
            bucket_mb = config.bucket_cap_mb
            if config.grad_compression == "powersgd" and device.type == "cpu":
                # gloo + PowerSGD needs one bucket (pytorch#58467).
                bucket_mb = sum(p.numel() * 4 for p in self.model.parameters()) / 2**20 + 1
            self.ddp = DDP(self.model, device_ids=[device] if device.type == "cuda" else None,
                           bucket_cap_mb=bucket_mb)
            _register_compression(self.ddp, config)
        self.writer = None
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.run_dir / "config.json",
                               lambda f: f.write(json.dumps(config.to_dict(), indent=2).encode()))
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def log(self, message: str) -> None:
        if self.info.is_main:
            print(message, flush=True)

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    def _resume(self) -> None:
        state = checkpoint.load_latest(self.run_dir, log=self.log)
        if state is None:
            self.log(f"starting a new run in {self.run_dir}")
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.best_bleu = state.get("best_bleu", -1.0)
        self.resumed_from = state["path"]
        self.log(f"resuming from {state['path']} at step {self.step}")

    def _state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "step": self.step, "best_bleu": self.best_bleu, "config": self.config.to_dict(),
                "vocabulary": str(Path(self.data.tokenizer.path).resolve()),
                "rng": {"torch": torch.get_rng_state(), "world_size": self.info.world_size}}

    def save(self, best: bool = False) -> None:
        if self.info.is_main:
            path = checkpoint.save(self.run_dir, self.step, self._state(),
                                   self.config.keep_checkpoints, best=best)
            self.log(f"checkpoint {path}")

    def _micro_batches(self) -> list[tuple[torch.Tensor, ...]]:
        c, world = self.config, self.info.world_size
        batches = []
        for micro in range(c.grad_accum):
            indices = global_batch_indices(self.step * c.grad_accum + micro, c.batch_per_gpu * world,
                                           len(self.data.train), c.seed)
            mine = rank_slice(indices, self.info.rank, world)
            batches.append(tuple(t.to(self.device) for t in self.data.train.batch(mine)))
        return batches

    def train_step(self) -> tuple[float, bool]:
        """One optimizer step. Returns (loss per target token, stop agreed by all ranks)."""
        c = self.config
        torch.manual_seed(c.seed * 7919 + self.step * self.info.world_size + self.info.rank)
        batches = self._micro_batches()
        stop = self.stop_requested or (self.info.is_main and (self.run_dir / "STOP").exists())
        counts = torch.tensor([sum(int(b[2].ne(PAD).sum()) for b in batches), float(stop)])
        distributed.all_reduce_sum(counts)
        tokens, stop = counts[0].item(), counts[1].item() > 0
        module = self.ddp or self.model
        self.model.train()
        total = 0.0
        for i, (src, tgt_in, tgt_out) in enumerate(batches):
            last = i == len(batches) - 1
            context = module.no_sync() if (self.ddp is not None and not last) else contextlib.nullcontext()
            with context, torch.autocast(self.device.type, dtype=self.amp_dtype,
                                         enabled=self.amp_dtype is not None):
                logits = module(src, tgt_in)
                loss_sum = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(),
                                           ignore_index=PAD, label_smoothing=c.label_smoothing,
                                           reduction="sum")
                # DDP averages over ranks; scaling by world/tokens makes it the global token mean.
                loss = loss_sum * self.info.world_size / tokens
            self.scaler.scale(loss).backward()
            total += loss_sum.item()
        self.scaler.unscale_(self.optimizer)
        if c.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        loss_total = distributed.all_reduce_sum(torch.tensor([total]))[0].item()
        return loss_total / tokens, stop

    def _write_progress(self, **values) -> None:
        if self.info.is_main:
            record = dict(values, step=self.step, max_steps=self.config.max_steps, time=time.time(),
                          world_size=self.info.world_size)
            atomic_write_bytes(self.run_dir / "progress.json",
                               lambda f: f.write(json.dumps(record).encode()))

    def fit(self) -> dict:
        c = self.config
        global_batch = c.batch_per_gpu * self.info.world_size * c.grad_accum
        step_times: list[float] = []
        last_eval: dict = {}
        ended = "max_steps"
        started = time.time()
        if self.step >= c.max_steps:
            self.log(f"run already at step {self.step} >= max steps {c.max_steps}")
        while self.step < c.max_steps:
            tick = time.perf_counter()
            loss, stop = self.train_step()
            step_times.append(time.perf_counter() - tick)
            recent = step_times[-c.log_every:]
            step_time = sum(recent) / len(recent)
            if self.writer:
                self.writer.add_scalar("train/loss", loss, self.step)
                self.writer.add_scalar("train/lr", self.scheduler.get_last_lr()[0], self.step)
                self.writer.add_scalar("perf/step_time_s", step_times[-1], self.step)
                self.writer.add_scalar("perf/objects_per_s", global_batch / step_times[-1], self.step)
            if self.step % c.log_every == 0 or self.step == 1:
                self.log(f"step {self.step}/{c.max_steps} | loss {loss:.3f} | lr "
                         f"{self.scheduler.get_last_lr()[0]:.2e} | {step_time * 1000:.0f} ms/step | "
                         f"{global_batch / step_time:.0f} objects/s")
                self._write_progress(loss=loss, avg_step_time_s=step_time)
            reached = False
            if self.step % c.eval_every == 0 or self.step == c.max_steps or stop:
                last_eval = self.run_eval()
                improved = last_eval["bleu"] > self.best_bleu
                self.best_bleu = max(self.best_bleu, last_eval["bleu"])
                reached = c.target_bleu is not None and last_eval["bleu"] >= c.target_bleu
                self.save(best=improved)
            elif self.step % c.checkpoint_every == 0:
                self.save()
            if stop:
                ended = "stop requested"
                if self.info.is_main:
                    (self.run_dir / "STOP").unlink(missing_ok=True)
                break
            if reached:
                ended = f"target BLEU {c.target_bleu} reached"
                break
        self.log(f"run ended at step {self.step}: {ended}")
        return self._summary(step_times, global_batch, last_eval, ended, time.time() - started)

    def run_eval(self) -> dict:
        result = evaluate(self.model, self.data, self.config, self.info, self.device)
        if self.info.is_main:
            eval_dir = self.run_dir / "eval"
            eval_dir.mkdir(exist_ok=True)
            for kind in ("hypotheses", "references", "sources"):
                text = "".join(line + "\n" for line in result.pop(kind))
                atomic_write_bytes(eval_dir / f"step_{self.step:08d}.{kind}.txt",
                                   lambda f, t=text: f.write(t.encode()))
            self.log(f"eval step {self.step} | loss {result['eval_loss']:.3f} | "
                     f"BLEU {result['bleu']:.1f} | exact {result['exact_match']:.1%}")
            if self.writer:
                for key in ("eval_loss", "bleu", "exact_match"):
                    self.writer.add_scalar(f"eval/{key}", result[key], self.step)
        return result

    def _summary(self, step_times, global_batch, last_eval, ended, wall) -> dict:
        timed = step_times[min(5, len(step_times) - 1):] if step_times else []
        avg = sum(timed) / len(timed) if timed else 0.0
        steps = checkpoint.list_steps(self.run_dir)
        summary = {
            "recipe": self.config.recipe, "steps": self.step, "world_size": self.info.world_size,
            "global_batch": global_batch, "avg_step_time_s": avg,
            "objects_per_s": global_batch / avg if avg else 0.0,
            "eval_loss": last_eval.get("eval_loss"), "bleu": last_eval.get("bleu"),
            "exact_match": last_eval.get("exact_match"), "best_bleu": self.best_bleu,
            "checkpoint_mb": checkpoint.size_mb(steps[-1]) if steps else None,
            "precision": self.config.precision, "grad_compression": self.config.grad_compression,
            "resumed_from": self.resumed_from, "ended": ended, "wall_time_s": wall,
        }
        if self.info.is_main:
            atomic_write_bytes(self.run_dir / "summary.json",
                               lambda f: f.write(json.dumps(summary, indent=2).encode()))
            self._write_progress(loss=None, avg_step_time_s=avg, ended=ended)
            if self.writer:
                self.writer.close()
        return summary
