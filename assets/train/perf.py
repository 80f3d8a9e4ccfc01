"""The step's figures besides the breakdown: warm-up against the steady step, FLOPs per step and MFU,
the batch shapes a run met (and the commonest run once before step 1), and which attention kernels
compute it.

Warm-up: step times in windows of WINDOW steps; the run has settled at the first window from which
SETTLE_WINDOWS window medians in a row are within TOLERANCE of the steady level (the median of the
last half's window medians). Medians, so one slow step (a log step's read-back) moves nothing.

FLOPs: the matrix products as run (padded shapes), forward x 3 (backward: gradients of the inputs and
of the weights, each a forward's worth); normalisations, activations and the optimizer are left out,
as MFU conventionally does (Chowdhery et al. 2022, appendix B). MFU: FLOPs per second over the GPUs'
datasheet dense 16-bit tensor peak.
"""

from __future__ import annotations

import contextlib
import re
import statistics
from collections import Counter
from typing import Any, Iterator

WINDOW = 10
SETTLE_WINDOWS = 3
TOLERANCE = 0.10
FIRST_STEPS = 50

# Datasheet dense (no sparsity) bf16 tensor-core peaks, TFLOP/s; the T4 has no bf16: its fp16. First match
# of the device name wins. NVIDIA publishes no A10G sheet: the A10's (the same GA102 chip) stands in.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH200\b", 989.4),
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH100\b", 989.4),
    (r"\bA100\b", 312.0),
    (r"\bL4\b", 121.0),
    (r"\bA10G?\b", 125.0),
    (r"\bT4\b", 65.0),
)


def peak_tflops(device_name: str) -> float | None:
    for pattern, peak in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peak
    return None


def measured_peak(device: Any, repeats: int = 10) -> tuple[str, float]:
    """(dtype, TFLOP/s) this device reaches on square matrix products, the conditions MFU's peak assumes:
    bf16 (fp16 where the GPU has none) at 8192 on a GPU, fp32 at 512 on a CPU; the fastest of `repeats`
    timed products after two untimed ones (allocation, kernel choice)."""
    import time

    import torch

    cuda = getattr(device, "type", "") == "cuda"
    size = 8192 if cuda else 512
    # Not emulated bf16 (torch >= 2.3 says a T4 supports it, by making a bf16 tensor): the tensor cores' own.
    native = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    dtype = (torch.bfloat16 if native else torch.float16) if cuda else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for i in range(2 + repeats):
        if cuda:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= 2:
            best = min(best, time.perf_counter() - began)
    return str(dtype).removeprefix("torch."), 2 * size**3 / best / 1e12


def mfu(flops_per_step: float, step_s: float, peak: float | None, gpus: int) -> float | None:
    """Model FLOPs utilisation: the step's FLOPs (all ranks) per second over `gpus` x the peak."""
    if not peak or not step_s or not flops_per_step:
        return None
    return flops_per_step / step_s / (peak * 1e12 * gpus)


def flops_text(parts: dict, device_name: str) -> str:
    """The step line's FLOPs and MFU from a rank's mean parts (its micro-batches' FLOPs, its step)."""
    flops, step = parts.get("flops", 0.0), parts.get("step_s", 0.0)
    if not flops or not step:
        return ""
    utilisation = mfu(flops, step, peak_tflops(device_name), 1)
    return f" | {flops / 1e12:.2f} TFLOP/step" + (f", MFU {utilisation:.1%}" if utilisation is not None else "")


def transformer_flops(d_model: int, ffn: int, layers: int, vocab: int, batch: int, src: int, tgt: int) -> int:
    """One micro-batch's training FLOPs (forward x 3) of nn.Transformer with a tied output projection.
    Per sequence, in multiply-adds: an encoder layer's projections and feed-forward (4d^2 + 2df) per
    source token and attention scores and values 2 S^2 d; a decoder layer's self-attention 4d^2, cross
    queries and output 2d^2 and feed-forward 2df per target token, cross keys and values 2d^2 per
    source token, attention 2 T^2 d + 2 T S d; the output projection d V per target token."""
    d, f = d_model, ffn
    encoder = src * (4 * d * d + 2 * d * f) + 2 * src * src * d
    decoder = tgt * (6 * d * d + 2 * d * f) + src * 2 * d * d + 2 * tgt * tgt * d + 2 * tgt * src * d
    forward_macs = batch * (layers * (encoder + decoder) + tgt * d * vocab)
    return 3 * 2 * forward_macs


def resnet_forward_flops(model: Any, size: int) -> int:
    """One image's forward FLOPs of vision.ResNet at size x size: its convolutions and the classifier."""

    def conv(layer, h: int, w: int) -> tuple[int, int, int]:
        (kh, kw), (sh, sw), (ph, pw) = layer.kernel_size, layer.stride, layer.padding
        ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        flops = 2 * layer.in_channels // layer.groups * kh * kw * layer.out_channels * ho * wo
        return flops, ho, wo

    total, h, w = conv(model.conv1, size, size)
    h, w = (h + 2 - 3) // 2 + 1, (w + 2 - 3) // 2 + 1  # maxpool 3, stride 2, padding 1
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for block in stage:
            convs = [block.conv1, block.conv2] + ([block.conv3] if hasattr(block, "conv3") else [])
            if block.downsample is not None:
                total += conv(block.downsample[0], h, w)[0]
            for layer in convs:
                flops, h, w = conv(layer, h, w)
                total += flops
    return total + 2 * model.fc.in_features * model.fc.out_features


def steady_state(step_times: list[float]) -> dict:
    """Warm-up (steps and seconds until the step time settles) and the steady step (the mean of the
    steps after it). A run too short to tell says so, with the mean of its steps after the fifth."""
    n = len(step_times)
    first = statistics.fmean(step_times[:FIRST_STEPS]) if n >= FIRST_STEPS else None
    head = {"first_50_mean_s": first, "first_step_s": step_times[0] if n else None}  # step 1: the process's start
    medians = [statistics.median(step_times[i : i + WINDOW]) for i in range(0, n - WINDOW + 1, WINDOW)]
    start = None
    if len(medians) >= 2 * SETTLE_WINDOWS:
        level = statistics.median(medians[len(medians) // 2 :])
        # Each window's mean against the level: one start-up step of seconds (cuDNN's autotuning of every
        # convolution at step 1) leaves its window's median alone, not the steady mean.
        means = [statistics.fmean(step_times[i : i + WINDOW]) for i in range(0, len(medians) * WINDOW, WINDOW)]
        within = [abs(m - level) <= TOLERANCE * level for m in means]
        start = next((k for k in range(len(within) - SETTLE_WINDOWS + 1) if all(within[k : k + SETTLE_WINDOWS])), None)
    if start is None:
        timed = step_times[min(5, n - 1) :] if n else []
        why = (
            f"{n} steps: too few to tell (at least {2 * SETTLE_WINDOWS * WINDOW})"
            if len(medians) < 2 * SETTLE_WINDOWS
            else f"the step time did not settle in {n} steps"
        )
        return {
            "settled": False,
            "note": why,
            "warmup_steps": None,
            "warmup_s": None,
            "steady_steps": len(timed),
            "steady_step_s": statistics.fmean(timed) if timed else 0.0,
            **head,
        }
    warm = start * WINDOW
    return {
        "settled": True,
        "note": f"settled after {warm} steps",
        "warmup_steps": warm,
        "warmup_s": sum(step_times[:warm]),
        "steady_steps": n - warm,
        "steady_step_s": statistics.fmean(step_times[warm:]),
        **head,
    }


class ShapeStats:
    """The batch shapes and padded tokens of the batches a run trained on (this process's steps)."""

    def __init__(self) -> None:
        self.shapes: Counter = Counter()
        self.pad = self.total = 0

    def add(self, records: list[tuple[tuple[int, ...], int, int]]) -> None:
        for shape, pad, total in records:
            self.shapes[shape] += 1
            self.pad, self.total = self.pad + pad, self.total + total

    def summary(self) -> dict:
        return {
            "distinct_shapes": len(self.shapes),
            "padded_fraction": self.pad / self.total if self.total else 0.0,
            "common_shapes": [[list(shape), count] for shape, count in self.shapes.most_common(5)],
        }


def attention_backends(choice: str) -> list | None:
    """--attention's SDPA backends (None: torch's own choice). auto: flash, then memory-efficient
    (which takes padding masks), math as the fallback; cuDNN's attention is left out, it builds an
    execution graph per new shape (~1.3 ms of CPU each on an H100, issue 29)."""
    if choice == "torch":
        return None
    from torch.nn.attention import SDPBackend

    fallback = [SDPBackend.MATH]
    return {
        "auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, *fallback],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION, *fallback],
        "flash": [SDPBackend.FLASH_ATTENTION, *fallback],
        "cudnn": [SDPBackend.CUDNN_ATTENTION, *fallback],
        "math": fallback,
    }[choice]


def attention_context(choice: str, device_type: str) -> contextlib.AbstractContextManager:
    """The SDPA backends for a training step: only on CUDA (CPUs have one fused kernel)."""
    backends = attention_backends(choice) if device_type == "cuda" else None
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(backends)


# --warm-shapes -1: this many of the commonest batch shapes on a GPU (the H200's budget run met 42), none on a
# CPU, which keeps no per-shape state worth paying for.
WARM_SHAPES_GPU = 64


def shapes_to_warm(requested: int, device_type: str) -> int:
    """--warm-shapes: how many batch shapes to run once before step 1 (-1: WARM_SHAPES_GPU on CUDA, else 0)."""
    if requested >= 0:
        return requested
    return WARM_SHAPES_GPU if device_type == "cuda" else 0


def warm_shapes(model: Any, batches: list, loss_sum: Any, device: Any, amp_dtype: Any, attention: str) -> None:
    """Each batch forward and backward once, as a training step runs it (autocast, the attention kernels,
    dropout), and nothing kept: gradients dropped, buffers restored, the RNGs as they were, no optimizer
    step. On a GPU a batch shape's first steps pay for its kernel plans and memory blocks: at 16k tokens
    steps 2-50 ran 1.31x the steady step in the trainer and 1.26x in a plain loop on the same batches,
    0.99x at one fixed shape (an H200, session 27). Before DDP wraps the model: no hook fires."""
    import torch

    model.train()
    with buffers_kept(model), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for batch in batches:
            with attention_context(attention, device.type):
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = loss_sum(model, batch)
                loss.backward()
            model.zero_grad(set_to_none=True)


@contextlib.contextmanager
def buffers_kept(model: Any) -> Iterator[None]:
    """The model's buffers (batch norm's statistics) as they were before the block, after it: steps run to
    warm or to measure (autocompress's probe) must not move them."""
    import torch

    kept = {name: value.clone() for name, value in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(kept[name])


def compiled(module: Any, varied_shapes: bool, backend: Any = "inductor") -> Any:
    """--compile: torch.compile'd. Token batches change shape every step: symbolic sizes from the first
    compile (not a static one, then a second), and no "duck sizing" (two sizes equal in one batch, rows
    and length say, would be assumed equal in all: a recompile at the next)."""
    import torch

    if not varied_shapes:
        return torch.compile(module, backend=backend)
    import torch.fx.experimental._config as shapes

    shapes.use_duck_shape = False
    return torch.compile(module, dynamic=True, backend=backend)
