"""The trainer's performance figures (train/perf.py): warm-up against the steady step, from a scripted
clock; FLOPs per step against torch.utils.flop_counter.FlopCounterMode on the real models (CPU, the
math attention backend: FlopCounterMode counts its matrix products); MFU against the datasheet peaks;
the SDPA backend choice; a checkpoint of an unfused optimizer resumed by a fused one; no host-device
synchronisation in a step.

Contracts: FlopCounterMode counts 2 FLOPs per multiply-add of mm/addmm/bmm/convolution, forward and
backward (torch/utils/flop_counter.py); sdpa_kernel(backends) enables only the listed backends
(docs.pytorch.org, torch.nn.attention.sdpa_kernel)."""

import threading
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train import perf
from train.config import ModelConfig, TrainConfig
from train.distributed import DistInfo


def test_warmup_ends_where_the_step_time_settles_and_one_slow_step_moves_nothing():
    times = [1.0] + [0.1] * 59 + [0.03] * 200
    times[150] = 0.5  # a log step's read-back
    result = perf.steady_state(times)
    assert result["settled"] and result["warmup_steps"] == 60
    assert result["warmup_s"] == pytest.approx(1.0 + 59 * 0.1)
    assert result["steady_steps"] == 200
    assert result["steady_step_s"] == pytest.approx((199 * 0.03 + 0.5) / 200)
    assert result["first_50_mean_s"] == pytest.approx((1.0 + 49 * 0.1) / 50)


def test_a_first_step_of_seconds_is_warm_up_not_a_part_of_the_steady_step():
    """ResNet-50 on an H200: step 1 took 11.3 s (cuDNN's autotuning), then 54 ms a step; the summary said
    111 ms over 200 steps (the window medians settled at once, so step 1 counted as steady)."""
    result = perf.steady_state([11.27] + [0.054] * 199)
    assert result["settled"] and result["warmup_steps"] == 10
    assert result["steady_step_s"] == pytest.approx(0.054)


def test_a_run_too_short_or_still_warming_says_so():
    short = perf.steady_state([0.2] + [0.1] * 29)
    assert not short["settled"] and "too few" in short["note"] and short["warmup_steps"] is None
    assert short["steady_step_s"] == pytest.approx(0.1) and short["first_50_mean_s"] is None
    falling = perf.steady_state([1.0 / (1 + i) for i in range(100)])  # never within 10% of its tail
    assert not falling["settled"] and "did not settle" in falling["note"]


class ScriptedClock:
    """Trainer.fit reads the clock before and after each step: the step takes the next scripted duration."""

    def __init__(self, durations):
        self.durations, self.calls, self.now = list(durations), 0, 1000.0

    def __call__(self) -> float:
        if self.calls % 2:
            self.now += self.durations[self.calls // 2]
        self.calls += 1
        return self.now


def test_the_summary_reports_warmup_the_steady_step_shapes_and_flops(numbers_data, tmp_path):
    from train.train import compose

    config = TrainConfig(
        recipe="transformer-tiny",
        data=str(numbers_data),
        run_dir=str(tmp_path / "run"),
        max_steps=60,
        batch_per_gpu=8,
        batching="tokens",
        eval_every=10**6,
        checkpoint_every=10**6,
        eval_samples=4,
        log_every=50,
        model=ModelConfig(d_model=32, layers=1, heads=2, ffn=32, dropout=0.0, max_len=64),
    )
    trainer = compose(config, DistInfo(), torch.device("cpu"))
    trainer.clock = ScriptedClock([0.5] * 20 + [0.1] * 40)
    summary = trainer.fit()
    warmup = summary["warmup"]
    assert warmup["settled"] and warmup["warmup_steps"] == 20 and warmup["warmup_s"] == pytest.approx(10.0)
    assert summary["avg_step_time_s"] == pytest.approx(0.1) and warmup["steady_steps"] == 40
    assert summary["objects_per_s"] == pytest.approx(8 / 0.1)
    shapes = summary["batch_shapes"]
    assert 1 <= shapes["distinct_shapes"] <= 60 and 0 < shapes["padded_fraction"] < 0.5
    assert all(src % 8 == 0 and tgt % 8 == 0 for (_, src, tgt), _ in shapes["common_shapes"])
    assert summary["flops_per_step"] > 0 and summary["mfu"] is None  # no peak for a CPU


def _tiny_transformer():
    from train.model import Transformer

    torch.manual_seed(0)
    config = ModelConfig(d_model=32, layers=2, heads=4, ffn=48, dropout=0.0, max_len=64)
    return Transformer(config, 50), config


def test_transformer_flops_equal_flop_counter_mode_forward_and_backward():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model, config = _tiny_transformer()
    model.train()
    batch, src_len, tgt_len = 3, 8, 16
    src = torch.randint(4, 50, (batch, src_len))
    tgt = torch.randint(4, 50, (batch, tgt_len))
    src[0, -2:] = 0  # padding masks on, as in training
    expected = perf.transformer_flops(config.d_model, config.ffn, config.layers, 50, batch, src_len, tgt_len)
    with sdpa_kernel([SDPBackend.MATH]):
        with FlopCounterMode(display=False) as forward:
            logits = model(src, tgt)
        with FlopCounterMode(display=False) as backward:
            logits.float().sum().backward()
    assert forward.get_total_flops() == expected // 3
    assert forward.get_total_flops() + backward.get_total_flops() == expected


def test_the_decoders_self_attention_is_the_causal_kernel_and_real_tokens_see_what_a_padding_mask_gives(
    monkeypatch,
):
    """Right-padded targets under the causal mask: no real token can see a PAD, so the decoder's
    self-attention needs no padding mask, and without one SDPA runs its causal kernel (flash on a GPU)
    instead of a (batch x heads, T, T) float mask merged every layer. The real positions' logits and
    every gradient are what the padding mask gives; PAD positions are not scored."""
    import torch.nn.functional as F

    from train.model import PAD

    model, _ = _tiny_transformer()
    model.train()
    src = torch.randint(4, 50, (3, 7))
    tgt = torch.randint(4, 50, (3, 9))
    src[0, -2:], tgt[1, -4:], tgt[2, -1:] = PAD, PAD, PAD
    real = tgt.ne(PAD)
    calls: list = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((q.size(-2), k.size(-2), attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kwargs)

    def loss_and_grads(logits):
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=PAD)
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    logits = model(src, tgt)
    monkeypatch.undo()
    self_attention = [c for c in calls if c[:2] == (9, 9)]
    assert len(self_attention) == 2 and all(c[2:] == (True, True) for c in self_attention)
    grads = loss_and_grads(logits)

    memory, src_pad = model.encode(src)
    length = tgt.size(1)
    masked = model.core.decoder(
        model._embed(tgt),
        memory,
        tgt_mask=torch.ones(length, length, dtype=torch.bool).triu(1),
        tgt_is_causal=True,
        tgt_key_padding_mask=tgt.eq(PAD),
        memory_key_padding_mask=src_pad,
    )
    expected = F.linear(masked, model.embed.weight)
    torch.testing.assert_close(logits[real], expected[real])
    for got, want in zip(grads, loss_and_grads(expected)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("arch, width, size", [("resnet18", 8, 32), ("resnet50", 8, 40)])
def test_resnet_forward_flops_equal_flop_counter_mode(arch, width, size):
    from torch.utils.flop_counter import FlopCounterMode

    from train.vision import ResNet

    model = ResNet(arch, 10, width).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(2, 3, size, size))
    assert counter.get_total_flops() == 2 * perf.resnet_forward_flops(model, size)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10G", 125.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", None),
        ("Tesla T4", 65.0),
        ("cpu", None),
    ],
)
def test_peaks_by_device_name(name, peak):
    assert perf.peak_tflops(name) == peak


def test_mfu_and_the_step_line_text():
    assert perf.mfu(100e12, 0.5, 400.0, 1) == pytest.approx(0.5)
    assert perf.mfu(200e12, 0.5, 400.0, 2) == pytest.approx(0.5)
    assert perf.mfu(1e12, 0.5, None, 1) is None
    text = perf.flops_text({"flops": 100e12, "step_s": 0.5}, "NVIDIA A100-SXM4-40GB")
    assert text == " | 100.00 TFLOP/step, MFU 64.1%"
    assert perf.flops_text({"flops": 1e12, "step_s": 0.5}, "cpu") == " | 1.00 TFLOP/step"


def test_the_attention_choice_leaves_cudnn_out_by_default_and_cpus_alone():
    from torch.nn.attention import SDPBackend

    auto = perf.attention_backends("auto")
    assert SDPBackend.CUDNN_ATTENTION not in auto and SDPBackend.EFFICIENT_ATTENTION in auto
    assert perf.attention_backends("torch") is None
    assert perf.attention_backends("cudnn")[0] == SDPBackend.CUDNN_ATTENTION
    with perf.attention_context("math", "cpu"):  # a no-op on a CPU
        assert torch.backends.cuda.cudnn_sdp_enabled() == torch.backends.cuda.cudnn_sdp_enabled()
    with perf.attention_context("math", "cuda"):  # the flags sdpa_kernel sets (no GPU needed to set them)
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()


def test_a_checkpoint_of_an_unfused_optimizer_resumes_fused(numbers_data, tmp_path, monkeypatch):
    """A run saved on a CPU (foreach Adam) resumed on a GPU (fused Adam): the resumed optimizer stays
    fused (load_state_dict would take the saved group's flags) and steps."""
    from train.train import compose

    def config(steps):
        return TrainConfig(
            recipe="transformer-tiny",
            data=str(numbers_data),
            run_dir=str(tmp_path),
            max_steps=steps,
            batch_per_gpu=8,
            eval_every=10**6,
            checkpoint_every=2,
            eval_samples=2,
            model=ModelConfig(d_model=32, layers=1, heads=2, ffn=32, dropout=0.0, max_len=64),
        )

    from train import recipes

    compose(config(2), DistInfo(), torch.device("cpu")).fit()
    monkeypatch.setattr(
        recipes.TranslationTask, "optimizer", lambda self: torch.optim.Adam(self.model.parameters(), lr=1.0, fused=True)
    )
    trainer = compose(config(3), DistInfo(), torch.device("cpu"))
    assert trainer.step == 2 and trainer.optimizer.param_groups[0]["fused"] is True
    assert trainer.fit()["steps"] == 3


def test_one_process_reads_its_stop_flags_on_the_host_without_waiting_for_the_device(
    numbers_data, tmp_path, monkeypatch
):
    """One process has no sum to wait for: the step's flags come from the host (a GPU's queue is never
    drained for them); the STOP file still stops the step it is seen at."""
    from cluster_node.protocol import rundir
    from train import distributed
    from train.train import compose

    made = []

    class Recorded(distributed.HostCopy):
        def __init__(self, tensor, local=None):
            super().__init__(tensor, local)
            made.append(self)

    monkeypatch.setattr(distributed, "HostCopy", Recorded)
    config = TrainConfig(
        recipe="transformer-tiny",
        data=str(numbers_data),
        run_dir=str(tmp_path),
        max_steps=5,
        batch_per_gpu=8,
        model=ModelConfig(d_model=32, layers=1, heads=2, ffn=32, dropout=0.0, max_len=64),
    )
    trainer = compose(config, DistInfo(), torch.device("cpu"))
    # units, stop, urgent stop, checkpoint due, snapshot due: all from the host
    assert trainer.train_step()[2] is False and made[-1].local == [0.0] * 5
    (tmp_path / rundir.STOP).write_text("stop\n")
    assert trainer.train_step()[2] is True and made[-1].local == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_compile_for_varied_shapes_is_one_graph_whatever_the_batch_shapes(monkeypatch):
    """--compile on token batches: the first batch had rows == length (16 x 16); torch.compile's default
    compiled a static graph, then recompiled, and duck sizing assumed rows == length until a batch broke
    it (a recompile each, minutes on a GPU). With symbolic sizes and no duck sizing: one graph."""
    import torch.fx.experimental._config as shapes

    monkeypatch.setattr(shapes, "use_duck_shape", True)  # torch's default, restored after
    graphs = []

    def counting(graph, inputs):
        graphs.append(graph)
        return graph.forward

    module = torch.nn.Linear(4, 4)
    step = perf.compiled(lambda src, tgt: module(src.float()).sum() + tgt.float().sum(), True, counting)
    for rows, source, target in ((16, 16, 16), (8, 24, 16), (32, 8, 40), (5, 8, 8)):
        step(torch.ones(rows, source, 4), torch.ones(rows, target))
    assert len(graphs) == 1
    torch._dynamo.reset()


def _caller(stack: list) -> str:
    """The first frame outside torch (and outside this module's recorders), as file:line."""
    torch_dir = str(Path(torch.__file__).parent)
    mine = [f for f in stack if not f.filename.startswith(torch_dir) and f.filename != __file__]
    return f"{Path(mine[-1].filename).name}:{mine[-1].lineno}" if mine else "torch"


def _optimizers_counter(stack: list) -> bool:
    """torch.optim's `_get_value(step)`: a CPU optimizer's step counter read on the host, by design (a GPU's
    fused optimizer keeps it on the device)."""
    return any(f.name == "_get_value" and f.filename.endswith("optim/optimizer.py") for f in stack)


class HostSyncs(TorchDispatchMode):
    """What would stall a GPU's queue in a step, each by the first frame outside torch that asked for it:
    a device value read on the host (`.item()`, `float(t)`: _local_scalar_dense); a Python value assigned
    into a device tensor's element (`t[i] = 1.0` copies a host scalar with cudaMemcpy and a stream sync:
    pytorch/pytorch#188267); ops whose output size depends on the values; and, recorded by `transfers` on the
    training thread, a move to a device that is not `non_blocking=True` (`.to(device)`, `.cuda()`: from
    pageable host memory it waits for the stream) and `.cpu()`. On a CPU nothing stalls, but the same calls
    run, and `torch.tensor`/`torch.as_tensor` given a device. Not seen on a CPU: `.tolist()` or `.numpy()` of a
    tensor that would be on the device (a host tensor's are the data pipeline's own work), `dst.copy_(host)`
    from a host tensor, nor what torch's C++ does inside an op."""

    VALUE_SIZED = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self._lifted: dict[int, torch.Tensor] = {}  # held: an id is not reused while its tensor lives

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "lift_fresh":
            self._lifted[id(out)] = out  # a tensor made from a Python value, on the host
        elif (name == "copy_" and id(args[1]) in self._lifted) or name in self.VALUE_SIZED | {"_local_scalar_dense"}:
            stack = traceback.extract_stack()[:-1]
            if not _optimizers_counter(stack):
                self.found.append(f"{name} at {_caller(stack)}")
        return out

    def transfers(self, monkeypatch) -> None:
        """Tensor methods that move data between the host and a device, wrapped for the mode's life."""

        def moves(args, kwargs) -> bool:
            where = [*args, kwargs.get("device")]
            return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in where if a is not None)

        def recorded(method: str, blocking):
            original = getattr(torch.Tensor, method)

            def wrapper(tensor, *args, **kwargs):
                if threading.current_thread() is threading.main_thread() and blocking(args, kwargs):
                    stack = traceback.extract_stack()[:-1]
                    if not stack[-1].filename.startswith(str(Path(torch.__file__).parent)):  # torch's own: same device
                        self.found.append(f"Tensor.{method} at {_caller(stack)}")
                return original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, method, wrapper)

        recorded("to", lambda args, kwargs: moves(args, kwargs) and not kwargs.get("non_blocking"))
        recorded("cuda", lambda args, kwargs: not kwargs.get("non_blocking"))
        recorded("cpu", lambda args, kwargs: True)
        for make in ("tensor", "as_tensor"):  # host values made on a device: a copy that waits (#190217)
            original = getattr(torch, make)

            def made(*args, _original=original, _make=make, **kwargs):
                if threading.current_thread() is threading.main_thread() and kwargs.get("device") is not None:
                    self.found.append(f"torch.{_make}(device=) at {_caller(traceback.extract_stack()[:-1])}")
                return _original(*args, **kwargs)

            monkeypatch.setattr(torch, make, made)


def _jpeg_folder(root: Path) -> Path:
    from PIL import Image

    for split in ("train", "val"):
        for label, color in enumerate(((200, 30, 30), (30, 30, 200))):
            (root / split / f"c{label}").mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40 + 3 * i, 36), color).save(root / split / f"c{label}" / f"{i}.jpg")
    return root


@pytest.mark.parametrize(
    "argv",
    [
        ["--recipe", "transformer-tiny", "--grad-accum", "2", "--d-model", "32", "--heads", "2", "--ffn", "32"],
        ["--recipe", "resnet-small", "--synthetic", "--batch-per-gpu", "4", "--image-size", "32", "--width", "8"],
        ["--recipe", "resnet-small", "--batch-per-gpu", "4", "--image-size", "32", "--width", "8", "--workers", "0"],
    ],
    ids=["transformer", "resnet-synthetic", "resnet-jpegs"],
)
def test_a_training_step_makes_no_host_device_synchronisation_of_its_own(argv, numbers_data, tmp_path, monkeypatch):
    """What a GPU's queue would wait for in steps 2-3 (the first builds the optimizer's state): nothing.
    Before session 28 the step set its flags by assignment (four waits a step) and the image path copied
    its normalisation constants to the device at every micro-batch (two more)."""
    from train.config import build_parser, config_from_args
    from train.train import compose

    data = _jpeg_folder(tmp_path / "jpegs") if "--workers" in argv else numbers_data
    places = ["--data", str(data), "--run-dir", str(tmp_path / "run"), "--eval-every", "1000", "--log-every", "1000"]
    trainer = compose(config_from_args(build_parser("").parse_args([*argv, *places])), DistInfo(), torch.device("cpu"))
    trainer.train_step()
    with monkeypatch.context() as patched, HostSyncs() as syncs:
        syncs.transfers(patched)
        trainer.train_step()
        trainer.train_step()
    assert syncs.found == []
