"""The translation input pipeline, in process (no torchrun): token-budget batches with length
bucketing, one permutation per epoch, the same batches for the same seed and after a resume, as
many batches on every rank, and the precision chosen from the device.

Contracts: fairseq's `--max-tokens` (fairseq/data/data_utils.py batch_by_size: a batch is full when
(sentences + 1) x the longest sentence's tokens would pass max_tokens; LanguagePairDataset.num_tokens
is max(source, target) length); PyTorch AMP (docs.pytorch.org/docs/stable/amp.html: float16 autocast
is used with GradScaler, gradients underflow otherwise; bfloat16 needs no scaler);
torch.cuda.is_bf16_supported(including_emulation=True) also says yes on a V100 that emulates bf16
(pytorch#124996), so the compute capability (>= 8.0: Ampere's bf16 tensor cores) decides too."""

import numpy as np
import pytest
import torch

from train.config import TrainConfig, choose_precision, settings_line
from train.data import BOS, EOS, PAD, DataSet, padded_fraction
from train.distributed import DistInfo
from train.recipes import TranslationTask

MAX_LEN = 64


def _task(data, *, world=1, rank=0, accum=1, seed=1234, batch=16, batching="tokens", pad=8) -> TranslationTask:
    from train.config import ModelConfig

    config = TrainConfig(
        recipe="transformer-tiny",
        data=str(data),
        batch_per_gpu=batch,
        grad_accum=accum,
        seed=seed,
        batching=batching,
        pad_multiple=pad,
        model=ModelConfig(d_model=32, layers=1, heads=2, ffn=32, dropout=0.0, max_len=MAX_LEN),
    )
    return TranslationTask(config, DistInfo(rank=rank, world_size=world), torch.device("cpu"))


def _rows(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The pairs of a batch as (source, target) token tuples, pads dropped: comparable across shapes."""
    src, _, tgt_out = batch
    return [(tuple(s[s.ne(PAD)].tolist()), tuple(t[t.ne(PAD)].tolist())) for s, t in zip(src, tgt_out)]


def test_token_batches_pad_at_most_a_tenth_and_hold_the_recipes_tokens_on_average(numbers_data):
    """--pad-multiple 1 (pad to the longest): pad-to-longest over random pairs pads 43% of the numbers
    data set's tokens; bucketed, <= 10%. The budget is --batch-per-gpu x the mean pair cost: batches
    carry the recipe's tokens on average (its pairs too, give or take: short-pair buckets hold more)."""
    task = _task(numbers_data, pad=1)
    pads = total = pairs = cost = 0
    for step in range(40):
        for batch in task.batches(step):
            pad, tokens = padded_fraction(batch)
            pads, total, pairs = pads + pad, total + tokens, pairs + len(batch[0])
            cost += int(torch.maximum(batch[0].ne(PAD).sum(1), batch[2].ne(PAD).sum(1)).sum())
            assert batch[0].numel() <= task.budget and batch[2].numel() <= task.budget
    print(f"padded tokens {pads / total:.1%}, {pairs / 40:.1f} pairs, {cost / 40 / task.budget:.0%} of the budget")
    assert pads / total <= 0.10
    assert 0.85 <= cost / 40 / task.budget <= 1 and 0.8 * 16 <= pairs / 40 <= 1.2 * 16


def test_shape_buckets_round_lengths_to_8_with_two_shapes_a_class_and_no_padding_beyond_the_rounding(numbers_data):
    """--pad-multiple 8 (new runs): every length a multiple of 8, at most two batch shapes per length
    class in an epoch (its full batches and its last), every row padded only up to its own length
    rounded to 8 (the class's width), within the budget, and --batch-per-gpu pairs a batch on average."""
    from train.sampler import round_up, side_costs

    task = _task(numbers_data, batch=16)
    sampler = task.sampler
    src_len, tgt_len = task.data.train.lengths()
    src_cost, tgt_cost = side_costs(src_len, tgt_len, MAX_LEN)
    rounding = round_up(src_cost, 8, MAX_LEN).sum() + round_up(tgt_cost, 8, MAX_LEN).sum()
    expected_pads = 1 - (src_cost.sum() + tgt_cost.sum()) / rounding
    epoch = sampler.epoch(0)
    shapes = {(len(b), *sampler.widths_of(b)) for b in epoch}
    assert len(shapes) <= 2 * len(sampler.classes) and len(sampler.classes) <= 2 * (MAX_LEN // 8)
    pads = total = 0
    for step in range(len(epoch)):
        ((src, tgt_in, tgt_out),) = task.batches(step)
        assert src.size(1) % 8 == 0 and tgt_in.size(1) % 8 == 0 and tgt_in.shape == tgt_out.shape
        assert len(src) * max(src.size(1), tgt_in.size(1)) <= task.budget
        pad, tokens = padded_fraction((src, tgt_in, tgt_out))
        pads, total = pads + pad, total + tokens
    task.loader.pool.shutdown(wait=True)  # the prefetched next epoch: not in the next test's count
    print(f"{len(shapes)} shapes in {len(sampler.classes)} classes; padded {pads / total:.1%}")
    assert pads / total == pytest.approx(expected_pads)  # the rounding's, nothing more
    assert task.shapes.summary()["padded_fraction"] == pytest.approx(expected_pads)
    assert task.shapes.summary()["distinct_shapes"] == len(shapes)
    assert 0.8 * 16 <= len(sampler.costs) / len(epoch) <= 1.05 * 16


def test_the_shapes_warmed_before_step_1_are_the_epochs_commonest_one_batch_each_most_tokens_first(numbers_data):
    """perf.warm_shapes' batches (a GPU's default: 64): each a distinct shape of the epoch the step is in, none
    left out that is commoner than one taken, the largest first; padded to the longest: none."""
    from collections import Counter

    task = _task(numbers_data, batch=16)
    counts = Counter((len(b), *task.sampler.widths_of(b)) for b in task.sampler.epoch(0))
    batches = task.shape_batches(0, 3)
    shapes = [(len(src), src.size(1), tgt_in.size(1)) for src, tgt_in, _ in batches]
    assert len(shapes) == len(set(shapes)) == 3 and len(counts) > 3
    assert min(counts[s] for s in shapes) >= max(n for s, n in counts.items() if s not in shapes)
    assert [r * (a + b) for r, a, b in shapes] == sorted((r * (a + b) for r, a, b in shapes), reverse=True)
    assert len(task.shape_batches(0, 1000)) == len(counts)
    assert task.shape_batches(0, 0) == [] and _task(numbers_data, pad=1).shape_batches(0, 8) == []


def test_warming_shapes_leaves_no_gradient_and_the_weights_buffers_and_random_state_as_they_were():
    """perf.warm_shapes in train mode (dropout draws, batch norm updates its statistics): nothing is kept."""
    from train.perf import warm_shapes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [(torch.randn(5, 6),), (torch.randn(3, 6),)]
    rng = torch.get_rng_state()
    warm_shapes(model, batches, lambda m, b: m(b[0]).sum(), torch.device("cpu"), None, "auto")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters())


def test_the_permutation_is_drawn_once_per_epoch_not_at_every_step(numbers_data, monkeypatch):
    calls = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: calls.append(a[0]) or randperm(*a, **k))
    task = _task(numbers_data)
    for step in range(30):
        task.batches(step)
    # one over the pairs, one over the epoch's buckets (all 31 steps, with the prefetched one, in epoch 0)
    assert sorted(calls, reverse=True)[:1] == [len(task.data.train)] and len(calls) == 2, calls


def test_the_same_seed_gives_the_same_batches_and_another_seed_others(numbers_data):
    first, again, other = _task(numbers_data), _task(numbers_data), _task(numbers_data, seed=7)
    for step in range(5):
        a, b, c = first.batches(step), again.batches(step), other.batches(step)
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        assert _rows(a[0]) != _rows(c[0])


def test_every_rank_gets_as_many_batches_and_one_global_step_is_one_set_of_buckets(numbers_data):
    """2 ranks x 1 micro-batch, 1 rank x 2 micro-batches: the same pairs at every step, also across
    an epoch boundary; every rank gets exactly grad_accum batches per step."""
    single = _task(numbers_data, accum=2, batch=256)
    ranks = [_task(numbers_data, world=2, rank=r, batch=256) for r in (0, 1)]
    steps_per_epoch = len(single.sampler.epoch(0)) // 2
    for step in (0, 1, steps_per_epoch - 1, steps_per_epoch, steps_per_epoch + 1):
        mine = [rank.batches(step) for rank in ranks]
        assert [len(m) for m in mine] == [1, 1]
        both = _rows(mine[0][0]) + _rows(mine[1][0])
        assert sorted(both) == sorted(_rows(single.batches(step)[0]) + _rows(single.batches(step)[1]))


def test_each_epoch_takes_every_pair_once(numbers_data):
    sampler = _task(numbers_data).sampler
    for epoch in (0, 1):
        pairs = np.concatenate(sampler.epoch(epoch))
        assert len(pairs) == len(np.unique(pairs)) == len(sampler.costs)
    assert [b.tolist() for b in sampler.epoch(0)[:3]] != [b.tolist() for b in sampler.epoch(1)[:3]]


@pytest.mark.parametrize("where", ["mid-epoch", "epoch boundary"])
def test_a_resumed_task_gives_the_batches_the_uninterrupted_one_gives(numbers_data, where):
    """A new task (a restarted process) at step k: the same batches as one that ran steps 0..k-1."""
    whole = _task(numbers_data, batch=256)
    per_epoch = len(whole.sampler.epoch(0))
    start = per_epoch // 2 if where == "mid-epoch" else per_epoch - 1
    for step in range(start):
        whole.batches(step)
    resumed = _task(numbers_data, batch=256)
    for step in range(start, start + 3):
        assert all(torch.equal(a, b) for x, y in zip(whole.batches(step), resumed.batches(step)) for a, b in zip(x, y))
    assert resumed.sampler.epoch_of(start + 2)[0] == (0 if where == "mid-epoch" else 1)


def test_sentence_batching_keeps_the_old_samples_with_one_permutation_per_epoch(numbers_data):
    """--batching sentences (and runs saved before token batching) see the pairs
    data.global_batch_indices always gave."""
    from train.data import global_batch_indices, rank_slice

    task = _task(numbers_data, world=2, rank=1, batching="sentences", batch=1000)
    data = task.data.train
    for step in (0, 5, 6):  # 6000 pairs = 3 global batches of 2000: steps 3.. are later epochs
        expected = data.batch(rank_slice(global_batch_indices(step, 2000, len(data), 1234), 1, 2))
        assert all(torch.equal(a, b) for a, b in zip(task.batches(step)[0], expected))
    saved = TrainConfig().to_dict()
    del saved["batching"]
    assert TrainConfig.from_dict(saved).batching == "sentences"


def test_batches_are_built_as_the_row_by_row_padding_built_them(numbers_data):
    data = DataSet(numbers_data, 12)  # short: truncation too
    indices = [5, 0, 4321, 17, 5999]
    src, tgt_in, tgt_out = data.train.batch(indices)
    for row, i in enumerate(indices):
        s = data.train.source(i)
        t = data.train.target(i)
        assert src[row].tolist() == s + [PAD] * (src.shape[1] - len(s)) and s[-1] == EOS and len(s) <= 12
        assert tgt_in[row].tolist() == [BOS] + t + [PAD] * (tgt_in.shape[1] - len(t) - 1)
        assert tgt_out[row].tolist() == t + [EOS] + [PAD] * (tgt_out.shape[1] - len(t) - 1)
    assert src.dtype == torch.long and src.shape[1] == max(len(data.train.source(i)) for i in indices)


@pytest.mark.parametrize(
    "device, capability, bf16, expected",
    [
        ("cpu", None, False, "fp32"),
        ("cuda", (6, 0), False, "fp32"),  # P100: no tensor cores
        ("cuda", (7, 0), True, "fp16"),  # V100: bf16 only emulated (is_bf16_supported says yes)
        ("cuda", (7, 5), False, "fp16"),  # T4
        ("cuda", (8, 0), True, "bf16"),  # A100
        ("cuda", (8, 6), True, "bf16"),  # A10G: bf16 tensor cores at the fp16 rate
        ("cuda", (9, 0), True, "bf16"),  # H100
    ],
)
def test_auto_precision_follows_the_compute_capability(device, capability, bf16, expected):
    precision, why = choose_precision("auto", device, capability, bf16)
    assert precision == expected and why.startswith("auto: ")


@pytest.mark.parametrize(
    "device, capability, bf16, expected",
    [
        ("cpu", None, False, "fp32"),
        ("cuda", (6, 1), False, "fp32"),  # no tensor cores
        ("cuda", (7, 5), False, "fp16"),  # T4
        ("cuda", (8, 0), True, "fp16"),  # A100: cuDNN's fp16 convolutions and batch norms beat its bf16 ones
        ("cuda", (9, 0), True, "fp16"),  # H100: 55 ms a ResNet-50 step in fp16, 66 in bf16
    ],
)
def test_auto_precision_of_a_convolutional_network_is_fp16_with_loss_scaling(device, capability, bf16, expected):
    precision, why = choose_precision("auto", device, capability, bf16, convolutional=True)
    assert precision == expected and why.startswith("auto: ")
    assert ("loss scaling on" in why) == (expected == "fp16")
    assert choose_precision("bf16", device, capability, bf16, convolutional=True) == ("bf16", "as requested")


def test_the_image_recipes_resolve_auto_as_convolutional_networks():
    from types import SimpleNamespace

    from train import config as config_module

    cuda = SimpleNamespace(type="cuda")
    for recipe, expected in (("resnet50", "fp16"), ("transformer-base", "bf16")):
        config = TrainConfig(recipe=recipe)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("torch.cuda.get_device_capability", lambda device: (9, 0))
            patch.setattr("torch.cuda.is_bf16_supported", lambda: True)
            config_module.resolve_precision(config, cuda)
        assert config.precision == expected, recipe


def test_an_explicit_precision_wins_and_the_settings_line_says_which_and_why():
    assert choose_precision("fp32", "cuda", (8, 0), True) == ("fp32", "as requested")
    assert choose_precision("fp16", "cpu", None, False) == ("fp16", "as requested")
    config = TrainConfig(recipe="transformer-tiny")
    assert config.precision == "auto"
    config.precision, why = choose_precision(config.precision, "cpu", None, False)
    assert "precision fp32 (auto: no CUDA device)" in settings_line(config, why)


def test_the_prefetcher_builds_each_step_once_in_order_and_raises_what_the_build_raised():
    """A step asked for twice (the start-of-run compression probe, then the step) is built once; the
    next one is already under way; a build's error reaches the trainer's thread."""
    from train.sampler import Prefetcher

    built = []

    def build(step):
        built.append(step)
        if step == 9:
            raise ValueError("shard 9 unreadable")
        return step * 10

    loader = Prefetcher(build)
    assert [loader.get(0), loader.get(0), loader.get(1), loader.get(5)] == [0, 0, 10, 50]
    loader.pool.shutdown(wait=True)
    assert built == [0, 1, 2, 5, 6]
    with pytest.raises(ValueError, match="shard 9"):
        Prefetcher(build).get(9)


def test_transformer_base_batches_by_tokens_and_the_numbers_toy_by_sentences():
    from train.config import build_parser, config_from_args

    def batching(*argv):
        return config_from_args(build_parser("").parse_args(list(argv))).batching

    assert batching("--recipe", "transformer-base") == "tokens"
    assert batching("--recipe", "transformer-tiny") == "sentences"
    assert batching("--recipe", "transformer-tiny", "--batching", "tokens") == "tokens"


def test_runs_saved_before_shape_buckets_keep_their_packing_and_new_ones_get_8(numbers_data):
    """A config.json without pad_multiple (saved before shape buckets) resumes with 1: the chunk-sorted
    buckets, so the same samples; a new run gets 8. Which kernels run (--attention, --compile) may
    change on a resume, the padding may not (it changes the samples)."""
    from train.config import RESUMABLE_CHANGES
    from train.sampler import ShapeBuckets, TokenBuckets

    saved = TrainConfig().to_dict()
    del saved["pad_multiple"]
    old = TrainConfig.from_dict(saved)
    assert old.pad_multiple == 1 and TrainConfig().pad_multiple == 8
    assert isinstance(_task(numbers_data, pad=1).sampler, TokenBuckets)
    assert isinstance(_task(numbers_data).sampler, ShapeBuckets)
    assert {"attention", "compile"} <= RESUMABLE_CHANGES and "pad_multiple" not in RESUMABLE_CHANGES
