"""scripts/bench_gpu.py's plain-PyTorch peers and data (from ../shared/gpu's baseline.py, diag.py and
makejpegs.py): what a careful user writes in one file, timed on the same machine in the same run.

- a prepared text data set with Ding-like lengths (median 11 tokens a side, 95th percentile ~22,
  correlated sides; the Ding dictionary itself is not on a GPU machine), token ids at random;
- the plain Transformer loop fed given batches (padding masks, causal mask) or one fixed shape;
- the plain ResNet-50 loop (channels-last, autocast, SGD) on one synthetic batch;
- ImageNet-like JPEGs (about 500x375, smooth content, so sizes and decode times are realistic).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from train.data import PAD, Tokenizer, atomic_write_bytes, write_pairs
from train.perf import steady_state

WINDOW = 10  # steps between device synchronisations when timing a plain loop


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_windows(step, steps: int) -> dict:
    """Step 1 on its own (the process's first: start-up, as the trainer reports it), then the mean step
    time per WINDOW steps (one sync per window, as a loop runs ahead of the device); the steady step
    and the first-50 mean as the trainer's summary finds them (perf.steady_state)."""
    sync()
    started = time.perf_counter()
    step()
    sync()
    times = [time.perf_counter() - started]
    while len(times) < steps:
        count = min(WINDOW, steps - len(times))
        sync()
        started = time.perf_counter()
        for _ in range(count):
            step()
        sync()
        times += [(time.perf_counter() - started) / count] * count
    state = steady_state(times)
    return {
        "steady_step_s": state["steady_step_s"],
        "settled": state["settled"],
        "warmup_steps": state["warmup_steps"],
        "first_50_mean_s": state["first_50_mean_s"],
        "first_step_s": state["first_step_s"],
        "windows_ms": window_means(times),
    }


def window_means(times: list[float], width: int = WINDOW) -> list[float]:
    """Mean milliseconds per `width` steps (step 1 on its own: it is start-up)."""
    rest = times[1:]
    return [round(1000 * statistics.fmean(rest[i : i + width]), 1) for i in range(0, len(rest), width)]


def text_data(out: Path, vocab: int, pairs: int, seed: int = 0) -> int:
    """A prepared data set (data.DataSet's layout): a BPE vocabulary trained on pseudo-words, train
    pairs of random ids with Ding-like lengths, valid/test from the pseudo-word text. Its vocabulary size."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lexicon = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(vocab * 2)]
    out.mkdir(parents=True, exist_ok=True)

    def lines(count: int) -> list[str]:
        return [" ".join(rng.choice(lexicon, size=int(rng.integers(3, 14)))) for _ in range(count)]

    corpus = lines(max(2000, vocab * 3))
    for name, text in (
        ("spm-corpus.en", corpus),
        *((f"{s}.{lang}", lines(64)) for s in ("valid", "test") for lang in ("en", "de")),
    ):
        atomic_write_bytes(out / name, lambda f, t=text: f.write("".join(x + "\n" for x in t).encode()))
    Tokenizer.train([str(out / "spm-corpus.en")], str(out / "spm"), vocab)
    tokenizer = Tokenizer(out / "spm.model")
    size = tokenizer.vocab_size
    src = np.clip(np.rint(rng.lognormal(np.log(11.0), 0.39, pairs)), 1, 200).astype(int)
    tgt = np.clip(np.rint(src * rng.lognormal(0.03, 0.25, pairs)), 1, 200).astype(int)
    ids = lambda n: rng.integers(4, size, n).tolist()  # noqa: E731
    write_pairs(out / "train-00000.pt", [ids(n) for n in src], [ids(n) for n in tgt])
    for split in ("valid", "test"):
        en, de = ((out / f"{split}.{lang}").read_text().splitlines() for lang in ("en", "de"))
        write_pairs(out / f"{split}.pt", tokenizer.encode(en), tokenizer.encode(de))
    meta = {"src_lang": "en", "tgt_lang": "de", "vocab_size": size, "sizes": {"train": pairs}, "synthetic": True}
    atomic_write_bytes(out / "meta.json", lambda f: f.write(json.dumps(meta).encode()))
    return size


class PlainTransformer(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, ffn: int):
        super().__init__()
        self.scale = d_model**0.5
        self.emb = nn.Embedding(vocab, d_model)
        self.core = nn.Transformer(d_model, heads, layers, layers, ffn, 0.1, batch_first=True)

    def forward(self, src, tgt, masks: bool):
        """`masks`: the source's padding masks, as the trainer's model passes them (right-padded targets under
        the causal mask need none: the trainer leaves them out, so a peer with them would be slower by that)."""
        causal = torch.ones(tgt.size(1), tgt.size(1), dtype=torch.bool, device=tgt.device).triu(1)  # the masks' type
        pad = src.eq(PAD) if masks else None
        hidden = self.core(
            self.emb(src) * self.scale,
            self.emb(tgt) * self.scale,
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=pad,
            memory_key_padding_mask=pad,
        )
        return hidden @ self.emb.weight.t()


def plain_transformer(
    model_args: dict, batches: list, steps: int, masks: bool, backends=None, window: ProfileWindow | None = None
) -> dict:
    """The plain loop over `batches` (src, tgt_in, tgt_out on the device), cycled; bf16 autocast and
    fused Adam on a GPU. `backends`: SDPA backends to pin (None: torch's own choice). `window`: profile
    those steps instead (its summary)."""
    dev = device()
    torch.manual_seed(0)
    model = PlainTransformer(**model_args).to(dev)
    cuda = dev.type == "cuda"
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True if cuda else None)
    position = [0]

    def step():
        src, tgt_in, tgt_out = batches[position[0] % len(batches)]
        position[0] += 1
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(src, tgt_in, masks)
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), tgt_out.flatten(), ignore_index=PAD, label_smoothing=0.1
            )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def profiled() -> dict:
        assert window is not None
        for number in range(1, window.last + 1):
            window.around(number, step)
        return window.summary

    measure = profiled if window else lambda: timed_windows(step, steps)
    if backends is None:
        return measure()
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends):
        return measure()


def fixed_batches(vocab: int, tokens: int, seq: int = 20) -> list:
    """baseline.py's batch: tokens // seq rows of seq tokens (target seq + 1), no padding."""
    dev, rows = device(), max(1, tokens // seq)
    src = torch.randint(4, vocab, (rows, seq), device=dev)
    tgt = torch.randint(4, vocab, (rows, seq + 1), device=dev)
    return [(src, tgt[:, :-1], tgt[:, 1:])]


def plain_resnet(batch: int, size: int, width: int, steps: int) -> dict:
    from train.vision import ResNet

    dev = device()
    cuda = dev.type == "cuda"
    torch.backends.cudnn.benchmark = True
    model = ResNet("resnet50", 1000, width).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.875, weight_decay=3e-5)
    x = torch.randn(batch, 3, size, size, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_windows(step, steps)


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float | None:
    """A bf16 n x n x n product's rate (a measured peak, beside the datasheet's); None on a CPU."""
    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * n**3 * repeats / (time.perf_counter() - started) / 1e12


def jpegs(root: Path, classes: int, per_class: int, scale: float = 1.0) -> float:
    """makejpegs.py's images in train/ and val/ class folders, made by a fresh process (its pool forks
    no CUDA context and no threads of this one); their mean size in KiB."""
    script = Path(__file__).with_name("gpu_jpegs.py")
    subprocess.run(
        [sys.executable, str(script), str(root), str(classes), str(per_class), str(scale)], check=True, timeout=300
    )
    sizes = [p.stat().st_size for p in root.rglob("*.JPEG")]
    return statistics.fmean(sizes) / 1024


def state_specs(model: nn.Module) -> list[tuple[torch.Size, torch.dtype]]:
    """The shapes of a training state like the trainer's snapshot: each parameter, Adam's two moments
    for it and its step count."""
    params = [(p.shape, p.dtype) for p in model.parameters()]
    return params * 3 + [(torch.Size([]), torch.float32)] * len(params)


def launch_contention(specs: list, seconds: float = 1.0) -> dict:
    """Kernel launches a second from this thread, alone and while another thread allocates host buffers
    for `specs` (a training state) each way a snapshot writer could (allocation_ways). Each: the
    allocation's seconds and the launch rate meanwhile and then while it is held, against alone (session 23:
    a trainer holding its registered block ran 1.28x the plain loop on the same steps, 1.05x without it); a
    registered block's seconds with
    no launches beside it too (the allocator caches what it frees: its ways are timed once); then what a
    snapshot's copy costs into pinned and into pageable buffers (snapshot_copies). Nothing on a CPU."""
    if not torch.cuda.is_available():
        return {"cuda": False}
    x = torch.zeros(1024, device="cuda")

    def launches(until) -> float:
        count, started = 0, time.perf_counter()
        while not until(count, time.perf_counter() - started):
            for _ in range(100):
                x.add_(1.0)
            count += 100
        sync()
        return count / (time.perf_counter() - started)

    total = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs)
    alone = launches(lambda n, t: t >= seconds)
    out: dict = {"state_mb": total / 1e6, "tensors": len(specs), "launches_per_s_alone": alone}
    for name, (allocate, release) in allocation_ways(specs, total).items():
        out[name] = beside_launches(allocate, launches, alone)
        if "error" not in out[name]:  # and once it is made, while it is held (a trainer holds it all its run)
            out[name]["held_rate_vs_alone"] = launches(lambda n, t: t >= seconds) / alone
        if release and "error" not in out[name]:
            release(out[name].pop("held"))
            started = time.perf_counter()
            again = allocate()
            out[name]["allocate_alone_s"] = time.perf_counter() - started
            release(again)
        out[name].pop("held", None)
    out["copy_s"] = snapshot_copies(specs)
    return out


def allocation_ways(specs: list, total: int) -> dict:
    """name: (allocate, undo its registration or None): pageable only (train.snapshot.StateWriter's
    default), one pageable block touched then registered with CUDA (cudaHostRegister; StateWriter's
    lock=True), pinned per tensor by torch's caching host allocator, pinned as one block."""
    cudart = torch.cuda.cudart()

    def block() -> torch.Tensor:
        return torch.zeros(total, dtype=torch.uint8)  # pageable, its pages touched

    def registered() -> torch.Tensor:
        memory = block()
        torch.cuda.check_error(cudart.cudaHostRegister(memory.data_ptr(), total, 0))
        return memory

    def unregister(memory: torch.Tensor) -> None:
        torch.cuda.check_error(cudart.cudaHostUnregister(memory.data_ptr()))

    # The ways that free what they lock first: torch's pinned allocator keeps what it frees page-locked
    # (cached), and each way's launches while it is held must not have another's locked memory beside them.
    return {
        "pageable only (the writer since session 23)": (block, None),
        "one pageable block, registered (sessions 19-22)": (registered, unregister),
        "pinned per tensor (before session 19)": (
            lambda: [torch.empty(s, dtype=d, pin_memory=True) for s, d in specs],
            None,
        ),
        "pinned, one block (rounded up to a power of two)": (
            lambda: torch.empty(total, dtype=torch.uint8, pin_memory=True),
            None,
        ),
    }


def beside_launches(allocate, launches, alone: float) -> dict:
    """allocate() on another thread while this one launches kernels: its seconds, the launch rate against
    `alone`, and what it allocated (`held`); an allocation that raises is recorded, not raised."""
    import threading

    held: list = []

    def work() -> None:
        started = time.perf_counter()
        try:
            held.append(allocate())
        except Exception as error:  # one way refused (a host without registration): the others still run
            held.append(error)
        held.append(time.perf_counter() - started)

    thread = threading.Thread(target=work)
    thread.start()
    rate = launches(lambda n, t: not thread.is_alive() and n > 0)
    thread.join()
    if isinstance(held[0], Exception):
        return {"error": f"{type(held[0]).__name__}: {held[0]}"}
    return {"allocate_s": held[1], "launch_rate_vs_alone": rate / alone, "held": held[0]}


def snapshot_copies(specs: list) -> dict:
    """Seconds to copy a state of `specs` from the GPU into host buffers, per tensor as the snapshot
    writer does: pinned (asynchronous, then one wait) against pageable (each copy synchronous)."""
    state = [torch.ones(shape, dtype=dtype, device="cuda") for shape, dtype in specs]
    out = {}
    for name, pin in (("pinned", True), ("pageable", False)):
        buffers = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for shape, dtype in specs]
        for _ in range(2):  # the second copy is timed: the first touches what it must
            sync()
            started = time.perf_counter()
            for buffer, tensor in zip(buffers, state):
                buffer.copy_(tensor, non_blocking=True)
            sync()
            out[name] = time.perf_counter() - started
    return out


class ProfileWindow:
    """torch.profiler over steps first..last of a loop (call around(step_number, step)); its summary per
    step: wall, self CPU and device time, kernel launches, and the top operators by self CPU time."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.summary: dict = {}
        self.profiler = None
        self.started = 0.0

    def around(self, number: int, step):
        from torch.profiler import ProfilerActivity, profile

        if number == self.first:
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
            self.started = time.perf_counter()
        result = step()
        if number == self.last and self.profiler is not None:
            sync()
            wall = time.perf_counter() - self.started
            self.profiler.__exit__(None, None, None)
            self.summary = self._summarise(self.profiler.key_averages(), wall, self.last - self.first + 1)
        return result

    @staticmethod
    def _summarise(events, wall: float, steps: int) -> dict:
        from torch.autograd import DeviceType

        def device_us(e) -> float:
            return getattr(e, "self_device_time_total", 0) or 0

        # The kernels themselves: an operator's self device time is its kernels' again, an annotation's too.
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", 0)]
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
        return {
            "steps": steps,
            "wall_ms": 1000 * wall / steps,
            "self_cpu_ms": sum(e.self_cpu_time_total for e in events) / steps / 1000,
            "device_ms": sum(device_us(e) for e in kernels) / steps / 1000,
            "launches": sum(e.count for e in events if "LaunchKernel" in e.key) / steps,
            "top": [
                [e.key, e.count / steps, e.self_cpu_time_total / steps / 1000, device_us(e) / steps / 1000] for e in top
            ],
        }
