"""The planner under LoRA: frozen base weights cost their BF16 copy only, adapters the full
2 + 4 + 12/DP bytes; a frozen layer's backward is one forward; DP reduces the adapters'
gradients only. Checked against by-hand parameter counts, and by the plans it makes: the same
sizes with LoRA recompute fewer layers, and the hand-set Megatron baseline fits more
configurations."""

import numpy as np
import pytest

from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.models.lora import LoraSpec
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.costs import MIB, analytic_costs
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.cost_model.lora_costs import lora_costs
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.search.request import PlanRequest
from tests.planner.test_planner_plan import EXAMPLE

MODEL = "internvl-6b-20b"


def test_static_memory_backward_and_sync_by_hand():
    model, hw = get_preset(MODEL), get_hardware("A100-80G")
    llm, v = model.llm, model.vit
    tp, dp, rank = 2, 4, 16
    lora = LoraSpec(rank=rank, alpha=32, targets=("linear_qkv", "linear_fc2", "vit.*"),
                    train=("projector",))  # fmt: skip
    full = analytic_costs(model, hw, tp, dp)
    got = lora_costs(full, model, lora, tp, dp)
    per = 2 + 4 + 12 / dp
    qkv = rank * (llm.hidden_size + llm.q_size + 2 * llm.kv_size)
    fc2 = rank * (llm.ffn_hidden_size + llm.hidden_size)
    i = got.names.index("llm.3")
    assert got.static_mib[i] == pytest.approx(
        (llm.layer_params * 2 + (qkv + fc2) * per) / tp / MIB)
    h, f = v.hidden_size, v.ffn_hidden_size  # qkv h -> 3h, proj h -> h, fc1 h -> f, fc2 f -> h
    vit_adapters = rank * ((h + 3 * h) + (h + h) + (h + f) + (f + h))
    j = got.names.index("vit.0")
    assert got.static_mib[j] == pytest.approx(
        (v.layer_params * 2 + vit_adapters * per) / tp / MIB)
    k = got.names.index("projector")
    embed = llm.vocab_size * llm.hidden_size
    assert got.static_mib[k] == pytest.approx(
        (embed * 2 + model.projector_params * per) / tp / MIB)
    # backward: one forward plus the weight gradients of what trains (a small share)
    share = (qkv + fc2) / llm.layer_params
    assert got.backward[i] == pytest.approx(full.forward[i] * (1 + share))
    assert np.all(got.backward[i] <= 0.51 * full.backward[i])
    synced, first, last = got.sync()
    assert synced[i] == pytest.approx((qkv + fc2) * per / tp / MIB)
    assert (first, last) == (0.0, 0.0)  # frozen patch embedding and head
    assert got.first[1].sum() == 0  # nothing before the frozen patch embedding needs gradients
    assert got.last_static_mib == pytest.approx(embed * 2 / tp / MIB)  # the head's BF16 copy


@pytest.fixture(scope="module")
def plans():
    stats = load_lengths(EXAMPLE)
    out = {}
    for name, lora in (("full", None), ("lora", LoraSpec(rank=16, alpha=32))):
        out[name] = make_plan(PlanRequest(
            model=get_preset(MODEL), hardware=get_hardware("A100-80G"), lengths=stats, gpus=32,
            tp=1, pp=8, micro_batches=16, global_batch=256, lora=lora))  # fmt: skip
    return out


def test_a_lora_plan_recomputes_less_and_its_baseline_fits_more(plans):
    full, lora = plans["full"], plans["lora"]
    recomputed = {k: sum(s.vit_recompute + s.llm_recompute for s in p.stages)
                  for k, p in plans.items()}  # fmt: skip
    assert recomputed["lora"] < recomputed["full"]
    assert all(s.peak_memory_gib <= 80 for s in lora.stages)
    assert lora.predicted.step_ms < full.predicted.step_ms
    base_full, base_lora = full.predicted.baseline, lora.predicted.baseline
    assert base_lora.configurations_fitting > base_full.configurations_fitting
    assert base_lora.step_ms < base_full.step_ms  # the same LoRA run, hand-set


def test_bad_lora_requests_name_the_flag():
    stats = load_lengths(EXAMPLE)
    kw = dict(model=get_preset("tiny"), hardware=get_hardware("A100-80G"), lengths=stats, gpus=2)
    with pytest.raises(ValueError, match="--lora-targets: 'q_proj' matches no layer"):
        PlanRequest(**kw, lora=LoraSpec(rank=4, alpha=8, targets=("q_proj",)))
    with pytest.raises(ValueError, match="--lora-rank 64 is above the width of llm.layers.0"):
        PlanRequest(**kw, lora=LoraSpec(rank=64, alpha=8))
    with pytest.raises(ValueError, match="--lora-rank with --profile"):
        PlanRequest(**kw, lora=LoraSpec(rank=4, alpha=8), profile={"layers": []})


def test_omnibal_plan_takes_the_lora_flags(tmp_path, capsys):
    from megatron_omnibal.cli import main
    from megatron_omnibal.data.lengths import from_arrays, save_lengths
    from megatron_omnibal.planner.plan_file.plan import load_plan

    rng = np.random.default_rng(0)
    vit = rng.integers(1, 4, 200)
    lengths = tmp_path / "lengths.npz"
    save_lengths(from_arrays(vit, vit * 4 + rng.integers(20, 200, 200)), lengths)
    args = ["plan", "--model", "tiny", "--hardware", "A100-80G", "--gpus", "2", "--tp", "1",
            "--pp", "2", "--lengths", str(lengths), "--global-batch", "16"]  # fmt: skip
    memory = {}
    for name, extra in (("full", []), ("lora", ["--lora-rank", "4", "--lora-targets",
                                                "linear_qkv,vit.*"])):  # fmt: skip
        out = tmp_path / f"{name}.json"
        assert main([*args, *extra, "--out", str(out)]) == 0
        memory[name] = [s.peak_memory_gib for s in load_plan(out).stages]
    assert sum(memory["lora"]) < sum(memory["full"])
    assert main([*args, "--lora-train", "projector", "--out", str(tmp_path / "x.json")]) == 2
    assert "--lora-targets / --lora-train need --lora-rank" in capsys.readouterr().err
