"""The C++ balancing core against its pure-Python reference, and both against the spec."""

import numpy as np
import pytest

from megatron_omnibal import _balance_core as core
from megatron_omnibal.balance import reference as ref
from megatron_omnibal.balance.core import ratio_band


def _params(module, kind, **fields):
    """module.IsfParams / SlotParams with these fields: one struct, the same in both."""
    p = getattr(module, kind)()
    for name, value in fields.items():
        setattr(p, name, value)
    return p


def _isf(module, vit, tokens, vb, tb, thresh, rounds, seed):
    return module.isf(vit, tokens, _params(module, "IsfParams", vit_budget=vb, token_budget=tb,
                                           token_threshold=thresh, rounds=rounds, seed=seed))


def _slots(module, vit, weight, weight2, tokens, **fields):
    return module.slot_balance(vit, weight, weight2, tokens,
                               _params(module, "SlotParams", **fields))


def _samples(rng, n, vmax=5, with_text=False):
    low = 0 if with_text else 1
    vit = rng.integers(low, vmax + 1, n)
    tokens = 256 * vit + rng.integers(30, 900, n)
    return vit.astype(np.int64), tokens.astype(np.int64)


def test_splitmix64_known_answers():
    # Published splitmix64 outputs for seed 0 (Vigna's reference implementation).
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert core.random_u64(0, 3).tolist() == expected
    assert ref.random_u64(0, 3).tolist() == expected


@pytest.mark.parametrize("seed", [0, 1, 2**63 + 5, 2**64 - 1])
def test_rng_and_permutation_match_reference(seed):
    assert np.array_equal(core.random_u64(seed, 50), ref.random_u64(seed, 50))
    for n in (0, 1, 2, 17, 1000):
        perm = core.permutation(n, seed)
        assert np.array_equal(perm, ref.permutation(n, seed))
        assert sorted(perm.tolist()) == list(range(n))


def test_permutation_is_roughly_uniform():
    # Position of element 0 over many seeds: every slot of 5 is hit about equally often.
    hits = np.bincount([int(np.flatnonzero(core.permutation(5, s) == 0)[0])
                        for s in range(5000)], minlength=5)
    assert hits.min() > 850 and hits.max() < 1150


@pytest.mark.parametrize("seed", range(6))
def test_isf_matches_reference(seed):
    rng = np.random.default_rng(seed)
    vit, tokens = _samples(rng, int(rng.integers(1, 400)))
    vb, tb = int(rng.integers(5, 20)), int(rng.integers(2400, 6000))
    args = (vit, tokens, vb, tb, tb - 128, int(rng.integers(1, 6)), seed * 7)
    a, b = _isf(core, *args), _isf(ref, *args)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _spec_isf(vit, tokens, vb, tb, thresh, rounds, seed):
    """ISF as OmniBal describes it, written out plainly (keeps the last open pack)."""
    ids = list(range(len(vit)))
    out = []
    for r in range(rounds):
        if not ids:
            break
        order = [ids[i] for i in ref.permutation(len(ids), seed + r)]
        packs, cur, sv, st = [], [], 0, 0
        for i in order:
            if cur and (sv + vit[i] > vb or st + tokens[i] > tb):
                packs.append(cur)
                cur, sv, st = [], 0, 0
            cur.append(i)
            sv += vit[i]
            st += tokens[i]
        if cur:
            packs.append(cur)
        rest = []
        for p in packs:
            full = sum(vit[i] for i in p) == vb or sum(tokens[i] for i in p) >= thresh
            (out.append(p) if r == rounds - 1 or full else rest.extend(p))
        ids = rest
    return out


@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_isf_follows_the_spec(rounds):
    rng = np.random.default_rng(rounds)
    vit, tokens = _samples(rng, 300)
    samples, ptr = _isf(core, vit, tokens, 12, 3500, 3400, rounds, 11)
    got = [samples[a:b].tolist() for a, b in zip(ptr[:-1], ptr[1:], strict=True)]
    assert got == _spec_isf(vit.tolist(), tokens.tolist(), 12, 3500, 3400, rounds, 11)
    assert sorted(samples.tolist()) == list(range(300))  # none lost, none duplicated


def _heavy_mix(rng, n):
    """Mostly 5- and 3-tile samples, few 1-tile ones, some with long text (heavy samples whose
    packs give up tiles; exact tile sums that need the end game)."""
    vit = rng.choice([1, 3, 4, 5], size=n, p=[0.08, 0.34, 0.02, 0.56])
    text = rng.lognormal(np.log(90), 0.9, n).clip(30, 1300).astype(np.int64)
    return vit.astype(np.int64), (256 * vit + text).astype(np.int64)


@pytest.mark.parametrize("case", range(16))
def test_slot_balance_matches_reference(case):
    rng = np.random.default_rng(100 + case)
    n = int(rng.integers(1, 600))
    if case % 4 == 3:
        vit, tokens = _heavy_mix(rng, n)
    else:
        vit, tokens = _samples(rng, n, vmax=int(rng.integers(1, 6)), with_text=case % 2 == 1)
    weight = tokens if case % 3 else tokens + tokens**2 // 512  # cost-like weights too
    weight2 = (tokens + tokens**2 // 2048 if case % 4 else np.zeros_like(tokens))
    vb = int(max(vit.max(), rng.integers(5, 20)))
    tb = int(max(tokens.max(), rng.integers(2000, 6000)))
    packs = max(1, int(np.ceil(max(vit.sum() / max(vb, 1), tokens.sum() / tb))))
    packs += int(rng.integers(0, 3))
    grow = int(rng.integers(0, 3))
    lo, hi = ratio_band(vit, weight)
    fields = dict(vit_budget=vb, token_budget=tb, packs=packs, grow=grow,
                  max_uncut=int(rng.integers(0, 4)), seed=case, repair_passes=6, tol_div=400,
                  tol2_div=int(rng.choice([100, 400])), window=6, partners=3, ratio_lo=lo,
                  ratio_hi=hi)
    a = _slots(core, vit, weight, weight2, tokens, **fields)
    b = _slots(ref, vit, weight, weight2, tokens, **fields)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", range(4))
def test_slot_balance_places_every_sample_once_within_budgets(case):
    rng = np.random.default_rng(case)
    vit, tokens = _heavy_mix(rng, 3000) if case >= 2 else _samples(rng, 3000, with_text=case == 1)
    vb, tb = 18, 6000
    packs = int(np.ceil(vit.sum() / vb)) + 20
    lo, hi = ratio_band(vit, tokens)
    samples, ptr, leftover = _slots(core, vit, tokens, tokens + tokens**2 // 12288, tokens,
                                    vit_budget=vb, token_budget=tb, packs=packs, seed=case,
                                    repair_passes=8, tol2_div=100, ratio_lo=lo, ratio_hi=hi)
    assert len(ptr) == packs + 1
    assert sorted(np.concatenate([samples, leftover]).tolist()) == list(range(3000))
    pid = np.repeat(np.arange(packs), np.diff(ptr))
    assert np.bincount(pid, vit[samples], packs).max() <= vb
    assert np.bincount(pid, tokens[samples], packs).max() <= tb


@pytest.mark.parametrize("case", range(8))
def test_lpt_balance_matches_reference(case):
    rng = np.random.default_rng(300 + case)
    n = int(rng.integers(1, 700))
    vit, tokens = _samples(rng, n, vmax=int(rng.integers(1, 6)), with_text=case % 2 == 1)
    if case % 4 == 3:  # ties in tokens: the seeded order decides
        tokens = 256 * vit + 100
    vb = int(max(vit.max(), rng.integers(3, 12)))
    tb = int(max(tokens.max(), rng.integers(1500, 4000)))
    packs = max(1, int(np.ceil(tokens.sum() / tb)) + int(rng.integers(-2, 4)))
    fields = dict(vit_budget=vb, token_budget=tb, packs=packs, seed=case)
    a = core.lpt_balance(vit, tokens, _params(core, "SlotParams", **fields))
    b = ref.lpt_balance(vit, tokens, _params(ref, "SlotParams", **fields))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_lpt_balance_evens_tokens_and_leaves_no_pack_empty():
    """With room everywhere, longest-processing-time-first leaves packs at most one sample apart
    (max - min load <= the largest sample) and no pack empty while there are samples."""
    rng = np.random.default_rng(7)
    vit = rng.integers(1, 4, 5000).astype(np.int64)
    tokens = (256 * vit + rng.integers(10, 2000, 5000)).astype(np.int64)
    packs = 1500
    samples, ptr, leftover = core.lpt_balance(
        vit, tokens, _params(core, "SlotParams", vit_budget=40, token_budget=20_000,
                             packs=packs, seed=3))
    assert len(leftover) == 0 and sorted(samples.tolist()) == list(range(5000))
    pid = np.repeat(np.arange(packs), np.diff(ptr))
    load = np.bincount(pid, tokens[samples], packs)
    assert np.diff(ptr).min() >= 1
    assert load.max() - load.min() <= tokens.max()
    # tight budgets: whatever finds no room comes back, nothing is over a budget
    samples, ptr, leftover = core.lpt_balance(
        vit, tokens, _params(core, "SlotParams", vit_budget=6, token_budget=3000, packs=packs,
                             seed=3))
    assert sorted(np.concatenate([samples, leftover]).tolist()) == list(range(5000))
    pid = np.repeat(np.arange(packs), np.diff(ptr))
    assert np.bincount(pid, vit[samples], packs).max() <= 6
    assert np.bincount(pid, tokens[samples], packs).max() <= 3000


def test_slot_balance_rejects_bad_input():
    v = np.array([1, 9])
    for module in (core, ref):
        with pytest.raises(ValueError, match="vit values"):
            _slots(module, v, v, v, v, vit_budget=5, token_budget=100, packs=2)
        with pytest.raises(ValueError, match="equal length"):
            _slots(module, v, v[:1], v, v, vit_budget=9, token_budget=100, packs=2)
        with pytest.raises(ValueError, match="equal length"):
            _slots(module, v, v, v[:1], v, vit_budget=9, token_budget=100, packs=2)
        with pytest.raises(ValueError, match="weight2"):
            _slots(module, v, v, -v, v, vit_budget=9, token_budget=100, packs=2)
    with pytest.raises(ValueError, match="rounds"):
        _isf(core, v, v, 9, 100, 90, 0, 1)
    for module in (core, ref):
        with pytest.raises(ValueError, match="equal length"):
            module.lpt_balance(v, v[:1], _params(module, "SlotParams", packs=2))
