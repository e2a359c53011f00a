"""The baseline search: the best hand-set Megatron-LM configuration, against brute force.

Oracles: every configuration the flags allow is built with `baseline_from_config` (the
planner's Problem.evaluate + simulator, one by one) and the fastest that fits memory is taken
by exhaustion; the LLM splits are checked against megatron-core's own TransformerConfig
validation and get_num_layers_to_build.
"""

import itertools
import json
import warnings
from dataclasses import replace

import numpy as np
import pytest

from megatron_omnibal.cli import main
from megatron_omnibal.data.lengths import from_arrays, save_lengths
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.hardware import Hardware, get_hardware
from megatron_omnibal.planner.cost_model.memory import GIB_MIB
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.plan import load_plan
from megatron_omnibal.planner.search.baseline import (
    BaselineConfig,
    baseline_from_config,
    best_megatron_baseline,
    interleaved_splits,
    llm_splits,
)
from megatron_omnibal.planner.search.parallel_sizes import divisors, parallel_candidates
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import budget_mib


def _stats(seed: int, n: int = 300):
    rng = np.random.default_rng(seed)
    vit = rng.integers(1, 6, n)
    return from_arrays(vit, vit * 16 + rng.integers(8, 400, n))


def _all_configs(request: PlanRequest) -> list[BaselineConfig]:
    """Every configuration, written out independently of the search: compositions of the LLM
    layers whose middle stages are equal, each recompute choice."""
    model, gb = request.model, request.global_batch
    nl = model.llm.num_layers
    out = []
    for t, p, d in parallel_candidates(model, request.hardware, request.gpus, max_pp=nl):
        if gb % d:
            continue
        splits = [
            c
            for c in itertools.product(range(1, nl + 1), repeat=p)
            if sum(c) == nl and len(set(c[1:-1])) <= 1
        ]
        for mbs, split, vision in itertools.product(divisors(gb // d), splits, (False, True)):
            m = gb // d // mbs
            for v in (1, 2, 3, 4):
                # interleaved: pp >= 2, micro-batches divisible by pp, every rank's layers
                # divisible by its chunks (Megatron's checks, tested below)
                if v > 1 and (p < 2 or m % p or any(n % v for n in split)):
                    continue
                for k in range(max(split) // v + 1):
                    out.append(BaselineConfig(t, p, d, mbs, m, split, vision, k, v))
    return out


@pytest.mark.parametrize(
    ("name", "gpus", "global_batch", "network_gbs", "seed"),
    [("tiny", 8, 16, 25.0, 0), ("tiny", 8, 16, 0.5, 1), ("tiny", 4, 24, 25.0, 2),
     ("small", 4, 16, 25.0, 3)],
)  # fmt: skip
def test_search_finds_the_brute_force_best_under_every_budget(
    name, gpus, global_batch, network_gbs, seed
):
    """tiny (4 ViT + 4 LLM layers, TP 1/2) and small (12 + 8 layers): every configuration
    predicted one by one; at budgets from 'almost nothing fits' to 'everything fits' the search
    returns the fastest that fits, and counts what it considered. A slow network (0.5 GB/s)
    makes the gradient sync weigh in."""
    model = get_preset(name)
    hw = Hardware("probe", 100.0, 1e6, 300.0, network_gbs, gpus_per_node=2, reserve_gib=0.0,
                  efficiency=0.3)  # fmt: skip
    request = PlanRequest(model=model, hardware=hw, lengths=_stats(seed), gpus=gpus,
                          global_batch=global_batch, seed=seed)  # fmt: skip
    rows = []
    for config in _all_configs(request):
        base = baseline_from_config(request, config)
        rows.append((base.result.step_ms, float(base.part.memory_mib.max()), config))
    peaks = np.array([r[1] for r in rows])
    for quantile in (0.02, 0.2, 0.5, 1.0):
        budget_gib = float(np.quantile(peaks, quantile)) / GIB_MIB
        probe = replace(request, hardware=replace(hw, memory_gib=budget_gib))
        fitting = [r for r in rows if r[1] <= budget_mib(probe.hardware) + 1e-6]
        best_step = min(r[0] for r in fitting)
        found = best_megatron_baseline(probe)
        assert found.searched == len(rows)
        assert found.fitting == len(fitting)
        assert found.best.result.step_ms == pytest.approx(best_step, rel=1e-9)
        assert found.best.part.memory_mib.max() <= budget_mib(probe.hardware) + 1e-6
        assert found.best.config in {r[2] for r in fitting if r[0] <= best_step * (1 + 1e-9)}
    assert any(r[2].vpp > 1 for r in rows)  # the interleaved schedule is among them


def test_nothing_fits_means_no_baseline():
    model = get_preset("tiny")
    hw = Hardware("tiny-gpu", 100.0, 1e-4, 300.0, 25.0, reserve_gib=0.0)
    request = PlanRequest(model=model, hardware=hw, lengths=_stats(3), gpus=4, global_batch=8)
    found = best_megatron_baseline(request)
    assert found.best is None and found.fitting == 0 and found.searched > 0


def test_headline_only_against_a_baseline_that_fits(tmp_path, capsys):
    """internvl-6b-20b on 8 x A100-80G: the plan fits (it spreads the ViT over stages) while
    Megatron's layout (the whole 5.5B-parameter ViT on stage 0) fits nowhere; the plan has no
    speedup and says so. On 16 GPUs a baseline fits, and it is re-checked here on its own."""
    rng = np.random.default_rng(0)
    vit = rng.integers(1, 8, 2000)
    stats = from_arrays(vit, vit * 256 + rng.integers(20, 800, 2000))
    lengths = tmp_path / "lengths.npz"
    save_lengths(stats, lengths)
    model, hw = get_preset("internvl-6b-20b"), get_hardware("A100-80G")
    for gpus in (8, 16):
        request = PlanRequest(model=model, hardware=hw, lengths=stats, gpus=gpus,
                              global_batch=64, lengths_path=str(lengths))  # fmt: skip
        plan = make_plan(request)
        base = plan.predicted.baseline
        if gpus == 8:
            assert base is None and plan.predicted.speedup is None
            assert best_megatron_baseline(request).best is None
        else:
            assert base is not None
            assert max(base.peak_memory_gib) <= plan.memory_budget_gib
            config = BaselineConfig(
                base.tp, base.pp, base.dp, base.micro_batch_size, base.micro_batches,
                base.llm_layers_per_stage, base.recompute_vision, base.recompute_num_layers,
            )  # fmt: skip
            again = baseline_from_config(request, config)
            assert again.part.memory_mib.max() <= budget_mib(hw) + 1e-6
            want = again.result.step_ms / plan.predicted.step_ms
            assert plan.predicted.speedup == pytest.approx(want, rel=1e-3)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "internvl-6b-20b", "--hardware", "A100-80G", "--gpus", "8",
            "--global-batch", "64", "--lengths", str(lengths), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "no speedup to report: no Megatron-LM configuration" in first and "x " not in first
    assert load_plan(out).predicted.speedup is None
    assert main(["simulate", "--plan", str(out), "--baseline"]) == 2
    assert "no Megatron-LM configuration fits memory" in capsys.readouterr().err


def test_headline_is_printed_first_and_simulate_reproduces_the_baseline(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "internvl-6b-20b", "--hardware", "A100-80G", "--gpus", "32",
            "--lengths", "example", "--global-batch", "256", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    base = plan.predicted.baseline
    assert text.startswith(f"modeled speedup {plan.predicted.speedup:.2f}x over the best Megatron")
    assert plan.predicted.speedup == pytest.approx(base.step_ms / plan.predicted.step_ms, rel=1e-3)
    assert main(["simulate", "--plan", str(out), "--baseline"]) == 0
    sim = capsys.readouterr().out
    assert float(sim.split("step ")[1].split()[0]) == pytest.approx(base.step_ms, rel=1e-4)
    doc = json.loads(out.read_text())
    assert doc["predicted"]["same_parallel"]["unit_ranges"][0][0] == 0


@pytest.mark.megatron
def test_llm_splits_are_exactly_what_megatron_core_accepts():
    """Oracle: megatron-core 0.19's TransformerConfig validation and get_num_layers_to_build,
    over every --decoder-first/last-pipeline-num-layers value (or none: the even split)."""
    import torch

    warnings.filterwarnings("ignore")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    for layers, pp in itertools.product(range(1, 9), range(1, 6)):
        accepted = set()
        values = [None, *range(0, layers + 1)]
        for first, last in itertools.product(values, values):
            try:
                config = TransformerConfig(
                    num_layers=layers, hidden_size=8, num_attention_heads=2,
                    pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                    num_layers_in_first_pipeline_stage=first,
                    num_layers_in_last_pipeline_stage=last)  # fmt: skip
                split = tuple(get_num_layers_to_build(config, pp_rank=r) for r in range(pp))
            except (ValueError, AssertionError):
                continue
            if sum(split) == layers and min(split) >= 1:
                accepted.add(split)
        assert set(llm_splits(layers, pp)) == accepted, (layers, pp)


@pytest.mark.megatron
def test_interleaved_splits_are_what_megatron_core_accepts():
    """Oracle: megatron-core 0.19's TransformerConfig with a virtual pipeline size and
    get_num_layers_to_build per (rank, chunk): the (split, chunks) pairs it builds are those the
    baseline search uses, each chunk holding its rank's layers / chunks."""
    import torch

    warnings.filterwarnings("ignore")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    for layers, pp, vpp in itertools.product(range(2, 13), range(2, 5), range(2, 4)):
        accepted = set()
        values = [None, *range(1, layers + 1)]
        for first, last in itertools.product(values, values):
            try:
                config = TransformerConfig(
                    num_layers=layers, hidden_size=8, num_attention_heads=2,
                    pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                    virtual_pipeline_model_parallel_size=vpp,
                    num_layers_in_first_pipeline_stage=first,
                    num_layers_in_last_pipeline_stage=last)  # fmt: skip
                chunks = [
                    [get_num_layers_to_build(config, vp_stage=c, pp_rank=r) for c in range(vpp)]
                    for r in range(pp)
                ]
            except (ValueError, AssertionError):
                continue
            split = tuple(sum(c) for c in chunks)
            if sum(split) == layers and min(min(c) for c in chunks) >= 1:
                accepted.add(split)
                assert all(len(set(c)) == 1 for c in chunks), (layers, pp, vpp, chunks)
        ours = {s for s in llm_splits(layers, pp) if vpp in interleaved_splits(s, pp)}
        assert ours == accepted, (layers, pp, vpp)


@pytest.mark.parametrize("memory_gib", [0.075, 0.144, 0.278])
def test_plan_is_never_slower_than_the_baseline_when_memory_is_tight(memory_gib):
    """small (12 + 8 layers) on 4 GPUs, 256 samples per step, memory for a few samples per
    micro-batch: 2 or 4 micro-batches per stage hold too many samples (at 0.075 GiB none of
    them fits at all), while the hand-set baseline fits with a small micro-batch size. The
    plan searches micro-batches of about 1, 2 and 4 samples and the baseline's own count, and
    comes out at least as fast as the baseline, within memory."""
    hw = Hardware("probe", 100.0, memory_gib, 300.0, 25.0, gpus_per_node=4, reserve_gib=0.0,
                  efficiency=0.3)  # fmt: skip
    request = PlanRequest(model=get_preset("small"), hardware=hw, lengths=_stats(1, 600),
                          gpus=4, global_batch=256, seed=1)  # fmt: skip
    plan = make_plan(request)
    base = best_megatron_baseline(request).best
    assert plan.predicted.step_ms <= base.result.step_ms
    assert plan.predicted.speedup >= 1.0
    assert max(s.peak_memory_gib for s in plan.stages) <= memory_gib + 1e-3
