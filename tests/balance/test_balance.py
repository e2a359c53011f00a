"""balance(): every sample exactly once, budgets kept, oversize policies, layout, determinism,
and that our default beats ISF on the real data."""

from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.balance import layout, metrics
from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.budgets import auto_budget
from megatron_omnibal.balance.checks import check_plan
from megatron_omnibal.balance.config import BalanceConfig, PackCost
from megatron_omnibal.balance.mixes import HEAVY_TEXT, long_tail_mix
from megatron_omnibal.balance.plan_io import load_plan, save_plan
from megatron_omnibal.data.lengths import from_arrays, load_lengths

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "internvl_subset.npz"


@pytest.fixture(scope="module")
def real():
    return load_lengths(EXAMPLE)


@pytest.fixture(scope="module")
def subset(real):
    return real.subset(np.random.default_rng(0).permutation(len(real))[:6000])


def cfg(**kw):
    return BalanceConfig(**{"vit_budget": 18, "token_budget": 6016, **kw})


def _pack_sums(plan, values):
    pid = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_ptr))
    return np.bincount(pid, values[plan.samples], plan.num_packs)


def _check_plan(plan, lengths, dp, micro, vb, tb):
    """Independent of the balancer's own check: plain loops over the plan."""
    trained = np.sort(plan.samples)
    assert np.array_equal(np.sort(np.concatenate([trained, plan.skipped])),
                          np.arange(len(lengths)))
    assert plan.num_packs == plan.num_steps * dp * micro
    assert _pack_sums(plan, lengths.vit).max() <= vb
    assert _pack_sums(plan, lengths.tokens).max() <= tb
    slots = (plan.pack_step * dp + plan.pack_rank) * micro + plan.pack_micro
    assert np.array_equal(slots, np.arange(plan.num_packs))  # full grid, (step, rank, micro)


@pytest.mark.parametrize("algorithm", ["default", "isf"])
@pytest.mark.parametrize("mode", ["random", "grouped"])
@pytest.mark.parametrize("micro", [1, 3])
def test_every_sample_once_within_budgets(subset, algorithm, mode, micro):
    plan = balance(subset, cfg(dp_size=8, micro_batches=micro, seed=3, mode=mode,
                               algorithm=algorithm))
    _check_plan(plan, subset, 8, micro, 18, 6016)
    assert len(plan.skipped) == 0


def test_deterministic_for_a_seed(subset):
    kw = dict(dp_size=4, micro_batches=2)
    a, b = balance(subset, cfg(seed=5, **kw)), balance(subset, cfg(seed=5, **kw))
    c = balance(subset, cfg(seed=6, **kw))
    for name in ("samples", "pack_ptr", "pack_step", "pack_rank", "pack_micro"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.samples, c.samples)


def test_reference_backend_gives_the_same_plan(real):
    small = real.subset(np.arange(0, len(real), 250))  # 283 samples, all four datasets
    for algorithm, mode in (("default", "random"), ("default", "grouped"), ("isf", "random")):
        config = cfg(dp_size=4, seed=2, algorithm=algorithm, mode=mode)
        a = balance(small, config)
        b = balance(small, config, use_reference=True)
        assert np.array_equal(a.samples, b.samples) and np.array_equal(a.pack_ptr, b.pack_ptr)


def _with_oversize():
    rng = np.random.default_rng(1)
    vit = rng.integers(1, 6, 400)
    tokens = 256 * vit + rng.integers(50, 500, 400)
    vit[[7, 100]] = 30            # too many tiles
    tokens[[55]] = 9000           # too many tokens
    return from_arrays(vit, tokens), {7, 55, 100}


def test_oversize_error_names_the_sample():
    lengths, _ = _with_oversize()
    with pytest.raises(ValueError, match=r"sample 7 .*vit_num=30.*3 such sample"):
        balance(lengths, cfg(dp_size=2))


def test_oversize_solo_and_skip():
    lengths, over = _with_oversize()
    solo = balance(lengths, cfg(dp_size=2, oversize="solo"))
    check_plan(solo, lengths)
    packs = [set(solo.pack(p).tolist()) for p in range(solo.num_packs)]
    for i in over:
        assert {i} in packs  # a pack of its own
    tiles, tokens = _pack_sums(solo, lengths.vit), _pack_sums(solo, lengths.tokens)
    over_packs = {p for p in range(solo.num_packs) if tiles[p] > 18 or tokens[p] > 6016}
    assert {frozenset(solo.pack(p).tolist()) for p in over_packs} == {frozenset({i}) for i in over}
    skip = balance(lengths, cfg(dp_size=2, oversize="skip"))
    assert set(skip.skipped.tolist()) == over
    _check_plan(skip, lengths, 2, 1, 18, 6016)


def test_tiny_inputs_fill_the_grid():
    lengths = from_arrays([1, 2, 3], [300, 600, 900])
    plan = balance(lengths, cfg(dp_size=4, micro_batches=2))
    _check_plan(plan, lengths, 4, 2, 18, 6016)
    assert plan.num_steps == 1  # 8 packs, 5 of them empty


def test_bad_arguments_are_named(subset):
    with pytest.raises(ValueError, match="dp_size"):
        cfg(dp_size=0)
    with pytest.raises(ValueError, match="mode"):
        cfg(dp_size=2, mode="sorted")
    with pytest.raises(ValueError, match="oversize"):
        cfg(dp_size=2, oversize="drop")
    with pytest.raises(TypeError, match="BalanceConfig"):
        balance(subset, {"dp_size": 2})


def test_default_beats_isf_and_random_on_real_data(real):
    kw = dict(dp_size=64, micro_batches=1, seed=0)
    ours = metrics.summarize(balance(real, cfg(**kw)), real)
    isf = metrics.summarize(balance(real, cfg(algorithm="isf", **kw)), real)
    rnd = metrics.summarize(metrics.random_batching(real, dp_size=64, micro_batches=1,
                                                    samples_per_micro=4), real, packed=False)
    assert ours["tokens_max_mean"] < isf["tokens_max_mean"] - 0.05
    # issue 11's targets: tiles and tokens within 1%, modeled time within 1.5%, per step, with
    # the mix no more skewed than a plain shuffle's
    assert ours["tiles_max_mean"] <= 1.01 and ours["tokens_max_mean"] <= 1.01
    assert ours["time_max_mean"] <= 1.015
    assert ours["mix_skew_ratio"] <= 1.0
    assert ours["empty_packs"] == 0
    assert rnd["tokens_max_mean"] > 1.25
    grouped = metrics.summarize(balance(real, cfg(mode="grouped", **kw)), real)
    assert grouped["tokens_max_mean"] <= 1.005 and grouped["tiles_max_mean"] <= 1.005


def test_long_tail_mix_grouped_meets_the_targets():
    """Generated long-tail mix (text-only, multi-image, video-like) at 32 ranks: grouped steps
    keep tiles and tokens within 2% and the modeled time within 3%, with no empty pack."""
    mix = long_tail_mix(20_000, seed=0, long_share=0.0, max_frames=16)
    vb, tb = auto_budget(mix)
    for kw in (dict(vit_budget=vb, token_budget=tb),
               dict(vit_budget=18, token_budget=6016, oversize="skip")):
        plan = balance(mix, BalanceConfig(dp_size=32, mode="grouped", **kw))
        figures = metrics.summarize(plan, mix)
        assert figures["tiles_max_mean"] <= 1.02 and figures["tokens_max_mean"] <= 1.02
        assert figures["time_max_mean"] <= 1.03 and figures["empty_packs"] == 0


def test_long_tail_mix_random_with_solo_packs():
    """Random layout of the long-tail mix with its oversize samples in solo packs: the solo
    packs do not raise the level the other packs are measured by, so the packs heavy in modeled
    time among those still get steps of their own (before: 1.045 time max/mean at this size,
    1.037 at the bench's 100,000 samples)."""
    mix = long_tail_mix(20_000, seed=0, long_share=0.0, max_frames=16)
    plan = balance(mix, BalanceConfig(dp_size=32, vit_budget=18, token_budget=6016,
                                      oversize="solo"))
    figures = metrics.summarize(plan, mix)
    assert figures["tokens_max_mean"] <= 1.02 and figures["time_max_mean"] <= 1.04


@pytest.mark.parametrize("seed, mix_kw", [
    (0, HEAVY_TEXT),
    (1, HEAVY_TEXT),
    (2, {**HEAVY_TEXT, "shares": (0.30, 0.40, 0.20, 0.10), "text_median": 1500.0,
         "text_sigma": 0.8}),
])
def test_heavy_text_tail_random_meets_the_goal(seed, mix_kw):
    """The long-tail regime with a heavy text-only tail (a quarter or more text-only samples of
    median 1,500-2,000 tokens up to 6,000, beside images, multi-image samples and 8-16-frame
    videos), --auto-budget, 32 ranks, one micro-batch, random mode: tokens within 2% and modeled
    time within 3% per step (before the light packs got steps of their own: 1.022 / 1.037 at
    100,000 samples of the first mix), every sample once (balance() checks it)."""
    mix = long_tail_mix(30_000, seed=seed, long_share=0.0, max_frames=16, **mix_kw)
    vb, tb = auto_budget(mix)
    plan = balance(mix, BalanceConfig(dp_size=32, vit_budget=vb, token_budget=tb))
    figures = metrics.summarize(plan, mix)
    assert figures["tokens_max_mean"] <= 1.02 and figures["time_max_mean"] <= 1.03
    assert figures["tiles_max_mean"] <= 1.025 and figures["empty_packs"] == 0


def test_light_packs_are_taken_lightest_first_until_the_lack_is_within_tolerance():
    """Packs light in modeled time (a quarter of them 10% under) lower their random step's
    mean: light_packs takes them out, a step's worth at a time, lightest first, until what the
    packs left lack against the largest a random step draws (the 1 - 1/per_step quantile of
    the packs given) is within the tolerance in every size; with 4
    micro-batches (a rank sums 4 packs) the tolerance for tokens and time is 4x, and none is
    taken. tail_bands puts them in whole steps of their own."""
    rng = np.random.default_rng(7)
    num, per_step, tol = 32 * 60, 32, 0.015
    light = rng.random(num) < 0.25
    vit = np.full(num, 18.0)
    tok = 5000 + rng.normal(0, 5, num)
    time = tok * np.where(light, 0.9, 1.0)
    sizes = layout.relative_sizes(vit, tok, time)
    taken = layout.light_packs(sizes, np.arange(num), per_step, tol)
    assert len(taken) and len(taken) % per_step == 0 and light[taken].all()
    left = np.setdiff1d(np.arange(num), taken)
    top = np.quantile(sizes, 1 - 1 / per_step, axis=0, method="higher")
    assert ((top - sizes[left]).sum(axis=0) <= tol * top * len(left)).all()
    back = np.concatenate([left, taken[-per_step:]])  # one step's worth fewer taken: over
    assert (top - sizes[back]).sum(axis=0)[2] > tol * top[2] * len(back)
    assert len(layout.light_packs(sizes, np.arange(num), per_step, tol, 4)) == 0
    bands, rest = layout.tail_bands(sizes, per_step, tol)
    assert all(len(b) == per_step for b in bands)
    assert np.array_equal(np.sort(np.concatenate([*bands, rest])), np.arange(num))


def test_solo_packs_are_left_out_of_the_level():
    """relative_sizes measures against the packs within the budgets: packs 3% over those in
    time are over the tolerance even beside a tenth of solo packs three times as heavy, and
    tail_bands gives every one of them, and every solo pack, a step of its own."""
    rng = np.random.default_rng(3)
    num, per_step, tol = 64 * 40, 64, 0.015
    solo = rng.random(num) < 0.1
    heavy = ~solo & (rng.random(num) < 0.05)
    vit = np.where(solo, 30, 18).astype(float)
    tok = np.where(solo, 15000, 5000) + rng.normal(0, 5, num)
    time = tok * np.where(heavy, 1.03, 1.0)
    sizes = layout.relative_sizes(vit, tok, time, solo)
    assert abs(np.mean(sizes[~solo, 1]) - 1) < 1e-9
    bands, _ = layout.tail_bands(sizes, per_step, tol)
    banded = set(np.concatenate(bands).tolist())
    assert set(np.flatnonzero(heavy | solo).tolist()) <= banded


def test_tail_steps_hold_every_pack_over_the_tolerance():
    """Random layout: every pack over the median tiles or the mean tokens or time by more than
    the tolerance (times the micro-batches a rank sums) is in a step of its own kind (the tail),
    never in a random step; the light tile packs follow while their lack exceeds it; steps are
    whole and disjoint."""
    rng = np.random.default_rng(5)
    num, per_step, tol = 64 * 40, 64, 0.015
    vit = np.where(rng.random(num) < 0.1, rng.integers(12, 18, num), 18).astype(float)
    tok = vit * 280 + rng.normal(0, 30, num) + np.where(rng.random(num) < 0.05, 400, 0)
    time = tok + rng.normal(0, 20, num)
    sizes = layout.relative_sizes(vit, tok, time)
    bands, rest = layout.tail_bands(sizes, per_step, tol, 4)
    assert all(len(b) == per_step for b in bands)
    everything = np.sort(np.concatenate([*bands, rest]))
    assert np.array_equal(everything, np.arange(num))
    over = np.flatnonzero(sizes.max(axis=1) - 1 > 4 * tol)
    assert len(over) and set(over.tolist()) <= set(np.concatenate(bands).tolist())
    top = vit[rest].max()
    assert (top - vit[rest]).sum() <= tol * top * len(rest) + 18 * per_step
    step, rank, micro = layout.layout(vit, tok, time, 16, 4, "random", 0, None, tol)
    assert np.array_equal(np.bincount(step), np.full(40, per_step))
    for band in bands:  # a tail band is one whole step
        assert len(np.unique(step[band])) == 1


@pytest.mark.parametrize("top", [20, 1 << 50])
def test_sorted_keys_order_as_lexsort(top):
    """layout's one sort of combined keys gives np.lexsort's order over (major, minor, a
    distinct tie-break), for integer and float keys, and keys too wide to combine."""
    rng = np.random.default_rng(top % 7)
    num = 5000
    distinct = rng.permutation(num)[:3000]
    major, minor = rng.integers(0, 40, 3000), rng.integers(0, top, 3000)
    want = distinct[np.lexsort((distinct, minor, major))]
    for m in (minor, minor.astype(float) / 3):
        assert np.array_equal(layout._sorted_keys(major, m, distinct, num) % num, want)


def test_layout_of_integer_and_float_tiles_agree():
    """The layout sorts integer tile counts directly and other tile values by their ranks:
    the same packs give the same layout either way."""
    rng = np.random.default_rng(4)
    num = 16 * 4 * 30
    vit = rng.integers(10, 19, num)
    tok = vit * 300 + rng.normal(0, 40, num)
    dataset = rng.integers(0, 5, num)
    got = [layout.layout(v, tok, tok * 1.1, 16, 4, "random", 2, dataset) for v in (vit, vit * 1.0)]
    for a, b in zip(*got, strict=True):
        assert np.array_equal(a, b)


def test_grouped_steps_are_alike():
    """Grouped layout on two clusters of packs (small and large in every size): no step mixes
    them."""
    rng = np.random.default_rng(2)
    big = np.repeat([0, 1], 640)
    rng.shuffle(big)
    vit = np.where(big, 18, 9).astype(float)
    tok = vit * 300 + rng.normal(0, 20, len(vit))
    step, _, _ = layout.layout(vit, tok, tok * 1.1, 32, 2, "grouped", 0)
    for s in range(step.max() + 1):
        assert len(np.unique(big[step == s])) == 1


def test_cost_model_balances_attention(subset):
    cost = PackCost(tile_ms=(0.0,), token_ms=(1.0,), attention_ms=(1.0 / 256,))
    kw = dict(dp_size=8, seed=1)
    by_tokens = metrics.summarize(balance(subset, cfg(**kw)), subset, cost)
    by_cost = metrics.summarize(balance(subset, cfg(cost=cost, **kw)), subset, cost)
    assert by_cost["time_max_mean"] < by_tokens["time_max_mean"]
    with pytest.raises(ValueError, match="three numbers"):
        PackCost.parse("1,2")


def test_auto_budget(real):
    vb, tb = auto_budget(real, samples_per_pack=4)
    assert vb >= real.vit.max() and tb >= real.tokens.max()
    assert abs(vb / real.vit.mean() - 4) < 0.5
    assert tb % 64 == 0
    per_tile = real.tokens.sum() / real.vit.sum()
    assert vb * per_tile <= tb <= vb * per_tile * 1.1
    vb2, tb2 = auto_budget(real, samples_per_pack=8, max_token_budget=4096)
    assert tb2 <= 4096 and vb2 * per_tile <= 4096


def test_plan_file_round_trip(subset, tmp_path):
    plan = balance(subset, cfg(dp_size=4, micro_batches=2))
    save_plan(plan, tmp_path / "plan.npz")
    back = load_plan(tmp_path / "plan.npz")
    for name in ("samples", "pack_ptr", "pack_step", "pack_rank", "pack_micro", "skipped",
                 "pack_level"):
        assert np.array_equal(getattr(back, name), getattr(plan, name))
    assert back.meta["dp"] == 4 and back.meta["algorithm"] == "default"
    assert BalanceConfig.from_dict(back.meta) == cfg(dp_size=4, micro_batches=2)
    check_plan(back, subset)
    with np.load(tmp_path / "plan.npz") as z:
        assert z["samples"].dtype == np.int64 and z["meta"].shape == ()
    np.savez(tmp_path / "bad.npz", samples=plan.samples)
    with pytest.raises(ValueError, match="missing pack_ptr"):
        load_plan(tmp_path / "bad.npz")


def test_text_only_and_mixed_samples():
    rng = np.random.default_rng(0)
    text = from_arrays(np.zeros(2000, np.int64), rng.integers(100, 3000, 2000),
                       image_flags=np.zeros(2000, np.int64))
    plan = balance(text, BalanceConfig(dp_size=8, micro_batches=2, vit_budget=0,
                                       token_budget=8192))
    _check_plan(plan, text, 8, 2, 0, 8192)
    assert metrics.summarize(plan, text)["tokens_max_mean"] < 1.02
    vit = np.where(rng.random(2000) < 0.3, 0, rng.integers(1, 6, 2000))
    mixed = from_arrays(vit, 256 * vit + rng.integers(100, 900, 2000))
    plan = balance(mixed, cfg(dp_size=8))
    _check_plan(plan, mixed, 8, 1, 18, 6016)
    figures = metrics.summarize(plan, mixed)
    # Token-bound data (12 tiles' worth of tokens per pack); random batching: 1.64 / 1.36.
    assert figures["tokens_max_mean"] < 1.02 and figures["tiles_max_mean"] < 1.02


@pytest.mark.parametrize("trial", range(24))
def test_random_configurations_keep_every_invariant(trial):
    rng = np.random.default_rng(1000 + trial)
    n, vmax = int(rng.integers(1, 800)), int(rng.integers(0, 8))
    vit = rng.integers(0, vmax + 1, n)
    tokens = rng.integers(1, 3000, n) + 200 * vit
    lengths = from_arrays(vit, tokens)
    vb, tb = int(rng.integers(max(1, vmax), 30)), int(rng.integers(int(tokens.max()), 12000))
    dp, micro = int(rng.integers(1, 70)), int(rng.integers(1, 9))
    config = BalanceConfig(
        dp_size=dp, micro_batches=micro, vit_budget=vb, token_budget=tb, seed=trial,
        algorithm=("default", "isf")[trial % 2], mode=("random", "grouped")[trial // 2 % 2],
        cost=PackCost.parse("1,1,0.001") if trial % 3 == 0 else None)
    plan = balance(lengths, config)
    _check_plan(plan, lengths, dp, micro, vb, tb)
    if n <= 200:  # the pure-Python reference gives the same plan
        ref = balance(lengths, config, use_reference=True)
        assert np.array_equal(ref.samples, plan.samples)
        assert np.array_equal(ref.pack_ptr, plan.pack_ptr)


def test_pack_stats_summed_per_chunk_equal_sums_over_the_whole_data(subset, monkeypatch):
    """pack_level sums each chunk's pack figures from the chunk's arrays; they must equal the
    figures computed over the whole data afterwards, bit for bit (the layout orders by them)."""
    from megatron_omnibal.balance import packing
    from megatron_omnibal.balance.balancer import sample_ms, time_weight

    monkeypatch.setattr(packing, "CHUNK", 1000)  # 6 strided chunks
    vit, tok = subset.vit.astype(np.int64), subset.tokens.astype(np.int64)
    ms = sample_ms(subset, PackCost(tile_ms=(0.5,), token_ms=(0.01,), attention_ms=(3e-6,)))
    got = packing.pack_level(vit, tok, time_weight(ms, tok), np.zeros(len(subset), bool), ms,
                             subset.dataset, datasets=len(subset.names), vit_budget=18,
                             token_budget=6016, per_step=8, algorithm="default", repair=True,
                             seed=0, isf_rounds=10, isf_threshold=5888)
    num = len(got.ptr) - 1
    pid = np.repeat(np.arange(num), np.diff(got.ptr))
    for mine, values in ((got.stats.vit, vit), (got.stats.tokens, tok)):
        assert np.array_equal(mine, np.bincount(pid, values[got.samples], num).astype(np.int64))
    assert np.array_equal(got.stats.time.view(np.int64),
                          np.bincount(pid, ms[got.samples], num).view(np.int64))
    table = np.zeros((num, len(subset.names)), np.int64)
    np.add.at(table, (pid, subset.dataset[got.samples]), 1)
    assert np.array_equal(got.stats.dataset, table.argmax(axis=1))
