"""`omnibal convert` and `omnibal compare-hf` end to end, on tiny random HF checkpoints.

- Round trip: HF -> Megatron (torch format at TP=2 x PP=2, and torch_dist) -> HF gives the
  original tensors bit for bit, under the original names, and transformers loads the result
  with no missing or unexpected keys; for every family, InternVL3/3.5 (Qwen2.5, Qwen3) in both
  layouts, LLaVA on Llama-3.x, Qwen2.5-VL (hub and transformers layouts) and Qwen3-VL (the
  hub's layout: DeepStack mergers, a position table) included.
- One SGD step of InternVL3.5 (Qwen3) at TP=2 and at PP=3 equals TP=1's; so does one of
  Qwen2.5-VL (its vision tower over two stages at PP=3), whose exports transformers' forward
  equals (compare-hf).
- Fine-tuning: pretrain_vlm starts from the converted checkpoint (--pretrained-checkpoint),
  trains, saves; the export's transformers forward equals the Megatron stages' forward of the
  trained checkpoint (compare-hf), frozen parts are bit for bit the original and hold no
  optimizer state, and the ViT's learning-rate multiplier scales its SGD update exactly.
- Bad input: each error names the file, tensor or flag.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.megatron

from tests.helpers import hf_models  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}


def omnibal(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`omnibal ARGS` through the CLI's entry point in this process (its exit status and
    output as a process's): each command's own worker processes still run under torchrun, but
    the ~30 commands here do not each pay a Python, torch and megatron-core start-up.
    The planner tests run the entry point as a process of its own."""
    from megatron_omnibal.cli import main

    out, err = io.StringIO(), io.StringIO()
    with (mock.patch.dict(os.environ, ENV), contextlib.redirect_stdout(out),
          contextlib.redirect_stderr(err)):  # fmt: skip
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    proc = subprocess.CompletedProcess(["omnibal", *args], code, out.getvalue(), err.getvalue())
    if check and proc.returncode:
        pytest.fail(f"omnibal {' '.join(args)} -> {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, hf_models.Built]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "internvl_6b": hf_models.internvl(root / "internvl_6b", six_b=True),
        "internvl_300m": hf_models.internvl(root / "internvl_300m", six_b=False),
        "internvl_chat": hf_models.internvl_chat(root / "internvl_chat"),
        "llava": hf_models.llava(root / "llava"),
        "internvl3_5": hf_models.internvl(root / "internvl3_5", six_b=False, text="qwen3",
                                          tie=True),  # fmt: skip
        "internvl3_5_chat": hf_models.internvl_chat(root / "internvl3_5_chat", text="qwen3",
                                                    six_b=False),  # fmt: skip
        "internvl3_chat": hf_models.internvl_chat(root / "internvl3_chat", text="qwen2",
                                                  six_b=False),  # fmt: skip
        "llava_llama3": hf_models.llava(root / "llava_llama3", text="llama3"),
        "qwen2_5_vl": hf_models.qwen2_5_vl(root / "qwen2_5_vl"),
        "qwen2_5_vl_flat": hf_models.qwen2_5_vl(root / "qwen2_5_vl_flat", flat=True),
        "qwen3_vl": hf_models.qwen3_vl(root / "qwen3_vl", hub=True),
    }


@pytest.mark.parametrize("family", ["internvl_6b", "internvl_300m", "internvl_chat", "llava",
                                    "internvl3_5", "internvl3_5_chat", "internvl3_chat",
                                    "llava_llama3", "qwen2_5_vl", "qwen2_5_vl_flat",
                                    "qwen3_vl"])  # fmt: skip
def test_round_trip_is_bit_identical(models, family: str, tmp_path: Path) -> None:
    built = models[family]
    ckpt, back = tmp_path / "megatron", tmp_path / "hf"
    omnibal("convert", "hf-to-megatron", str(built.path), "--tp", "2",
            "--omnibal-vit-pp-layers", "3,1", "--omnibal-llm-pp-layers", "0,4",
            "--out", str(ckpt), "--no-progress")  # fmt: skip
    files = sorted(p.relative_to(ckpt).as_posix() for p in (ckpt / "release").rglob("*.pt"))
    assert files == [f"release/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt"
                     for t in range(2) for p in range(2)]  # fmt: skip
    omnibal("convert", "megatron-to-hf", str(ckpt), "--like", str(built.path), "--out",
            str(back), "--max-shard-size", "40KB", "--no-progress")  # fmt: skip
    original, exported = tensors(built.path), tensors(back)
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    shards = sorted(back.glob("model-*-of-*.safetensors"))
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"]) == set(original)
    assert (back / "config.json").read_text() == (built.path / "config.json").read_text()
    if built.family != "internvl_chat":  # transformers' own classes load the export
        from transformers import AutoModelForImageTextToText

        _, info = AutoModelForImageTextToText.from_pretrained(back, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_torch_dist_round_trip_and_compare_at_another_layout(models, tmp_path: Path) -> None:
    """torch_dist written by megatron-core in TP x PP processes; read back at another PP
    layout by compare-hf, and exported bit for bit."""
    built = models["llava"]
    ckpt = tmp_path / "dist"
    omnibal("convert", "hf-to-megatron", str(built.path), "--tp", "2",
            "--omnibal-vit-pp-layers", "4,0", "--omnibal-llm-pp-layers", "0,4",
            "--ckpt-format", "torch_dist", "--out", str(ckpt), "--no-progress")  # fmt: skip
    assert (ckpt / "release" / "metadata.json").is_file()
    report = json.loads(omnibal("compare-hf", str(built.path), str(ckpt), "--tp", "1",
                                "--omnibal-vit-pp-layers", "2,2,0,0",
                                "--omnibal-llm-pp-layers", "0,1,2,1").stdout)  # fmt: skip
    assert report["ok"] and report["pp"] == 4 and report["logits"]["max_rel"] <= 1e-4
    back = tmp_path / "hf"
    omnibal("convert", "megatron-to-hf", str(ckpt), "--like", str(built.path), "--out",
            str(back), "--no-progress")  # fmt: skip
    original, exported = tensors(built.path), tensors(back)
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


def _lengths(path: Path) -> Path:
    """40 records shaped for the tiny models (4 image tokens per tile)."""
    from megatron_omnibal.data.lengths import from_arrays, save_lengths

    rng = np.random.default_rng(0)
    vit = rng.integers(1, 4, 40)
    save_lengths(from_arrays(vit, vit * 4 + rng.integers(8, 30, 40), vit), path)
    return path


def _train(
    out: Path, model: Path, ckpt: Path, lengths: Path, *flags: str, nproc: int = 2
) -> None:
    from launch import run_local

    program = [
           "-m", "megatron_omnibal.pretrain_vlm", "--omnibal", "--omnibal-model", str(model),
           "--omnibal-lengths", str(lengths), "--omnibal-vit-budget", "8",
           "--omnibal-token-budget", "120", "--micro-batch-size", "1", "--global-batch-size",
           "2", "--transformer-impl", "local", "--seed", "3", "--train-iters", "3",
           "--lr", "1e-2", "--min-lr", "1e-2", "--lr-decay-style", "constant", "--clip-grad",
           "0", "--num-workers", "0", "--pretrained-checkpoint", str(ckpt), "--save",
           str(out), "--save-interval", "3", *flags]  # fmt: skip
    proc = run_local(nproc, program, 600, ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_fine_tune_export_equals_megatron_forward(models, tmp_path: Path) -> None:
    """Tied Qwen2 head across stages, padded ViT head at TP=2: train from the converted
    checkpoint, export, and transformers' forward of the export equals the trained stages'."""
    built = models["internvl_6b"]
    ckpt, trained, back = tmp_path / "converted", tmp_path / "trained", tmp_path / "hf"
    omnibal("convert", "hf-to-megatron", str(built.path), "--tp", "2",
            "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4",
            "--out", str(ckpt), "--no-progress")  # fmt: skip
    _train(trained, built.path, ckpt, _lengths(tmp_path / "lengths.npz"),
           "--tensor-model-parallel-size", "2", "--sequence-parallel",
           "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4")  # fmt: skip
    omnibal("convert", "megatron-to-hf", str(trained), "--like", str(built.path), "--out",
            str(back), "--no-progress")  # fmt: skip
    original, exported = tensors(built.path), tensors(back)
    changed = [n for n, t in original.items() if not torch.equal(exported[n], t)]
    assert len(changed) > len(original) // 2, "training changed too few tensors"
    report = json.loads(omnibal("compare-hf", str(back), str(trained)).stdout)
    assert report["ok"], report
    assert max(report[k]["max_rel"] for k in ("logits", "vit", "llm")) <= 1e-4


def test_uneven_layouts_convert_train_export_and_compare(tmp_path: Path) -> None:
    """5 LLM layers (tied Qwen2 head): converted to torch_dist on 2 stages (LLM 1 + 4), trained
    on 2 others (ViT 2 + 2, LLM 0 + 5) from that checkpoint, exported, and compared on 3
    stages (LLM 0 + 2 + 3): transformers' forward of the export equals the trained stages'."""
    built = hf_models.internvl(tmp_path / "internvl5", six_b=True, llm_layers=5)
    ckpt, trained, back = tmp_path / "converted", tmp_path / "trained", tmp_path / "hf"
    omnibal("convert", "hf-to-megatron", str(built.path), "--omnibal-vit-pp-layers", "4,0",
            "--omnibal-llm-pp-layers", "1,4", "--ckpt-format", "torch_dist", "--out", str(ckpt),
            "--no-progress")  # fmt: skip
    _train(trained, built.path, ckpt, _lengths(tmp_path / "lengths.npz"),
           "--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "2,2",
           "--omnibal-llm-pp-layers", "0,5")  # fmt: skip
    omnibal("convert", "megatron-to-hf", str(trained), "--like", str(built.path), "--out",
            str(back), "--no-progress")  # fmt: skip
    original, exported = tensors(built.path), tensors(back)
    assert sorted(exported) == sorted(original)
    assert sum(n.startswith("language_model.model.layers.4.") for n in exported) > 0
    changed = [n for n, t in original.items() if not torch.equal(exported[n], t)]
    assert len(changed) > len(original) // 2, "training changed too few tensors"
    report = json.loads(omnibal("compare-hf", str(back), str(trained), "--omnibal-vit-pp-layers",
                                "4,0,0", "--omnibal-llm-pp-layers", "0,2,3").stdout)  # fmt: skip
    assert report["ok"] and report["pp"] == 3, report
    assert max(report[k]["max_rel"] for k in ("logits", "vit", "llm")) <= 1e-4


# A tensor each family's step must move.
STEPPED = {"internvl3_5": "language_model.model.layers.0.self_attn.q_norm.weight",
           "qwen2_5_vl": "visual.blocks.0.attn.qkv.weight"}  # fmt: skip


@pytest.mark.parametrize("family", sorted(STEPPED))
def test_step_at_tp2_and_pp3_equals_tp1_and_exports(tmp_path: Path, family: str) -> None:
    """InternVL3.5 (Qwen3, tied head) and Qwen2.5-VL (hub layout, tied head: windowed and
    full attention, gated ViT MLP, merger, M-RoPE over packed samples), without dropout: one
    SGD step at TP=2 with sequence parallelism (the per-head QK-norm's gradient summed over the
    TP ranks' heads) and at PP=3 (the ViT over two stages, the tied head on another stage than
    the embedding) moves every tensor as at TP=1 from the same weights and data; each export
    loads in transformers and its forward equals the trained stages' (compare-hf)."""
    if family == "qwen2_5_vl":
        built = hf_models.qwen2_5_vl(tmp_path / family, flat=True, tie=True, llm_layers=3)
    else:
        built = hf_models.internvl(tmp_path / family, six_b=False, text="qwen3", tie=True,
                                   llm_layers=3)  # fmt: skip
    lengths = _lengths(tmp_path / "lengths.npz")
    one_stage = ["--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "3"]
    layouts = {
        "tp1": (1, "1", one_stage),
        "tp2": (2, "2", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                         *one_stage]),
        "pp3": (3, "1", ["--pipeline-model-parallel-size", "3", "--omnibal-vit-pp-layers",
                         "2,2,0", "--omnibal-llm-pp-layers", "0,1,2"]),
    }  # fmt: skip
    exported = {}
    for name, (nproc, tp, flags) in layouts.items():
        ckpt, trained, back = (tmp_path / f"{name}_{x}" for x in ("converted", "trained", "hf"))
        omnibal("convert", "hf-to-megatron", str(built.path), "--tp", tp, *flags[-4:],
                "--out", str(ckpt), "--no-progress")  # fmt: skip
        _train(trained, built.path, ckpt, lengths, *flags, "--optimizer", "sgd",
               "--sgd-momentum", "0", "--weight-decay", "0", "--train-iters", "1",
               "--save-interval", "1", "--ckpt-format", "torch", "--hidden-dropout", "0",
               "--attention-dropout", "0", nproc=nproc)  # fmt: skip
        omnibal("convert", "megatron-to-hf", str(trained), "--like", str(built.path), "--out",
                str(back), "--no-progress")  # fmt: skip
        exported[name] = tensors(back)
        report = json.loads(omnibal("compare-hf", str(back), str(trained)).stdout)
        assert report["ok"] and report["logits"]["max_rel"] <= 1e-4, report
    original = tensors(built.path)
    stepped = STEPPED[family]
    assert not torch.equal(exported["tp1"][stepped], original[stepped]), "no step"
    off = []
    for n, t in original.items():
        step = exported["tp1"][n] - t
        # Summation order differs between layouts: 1e-4 of the step, or an fp32 rounding of
        # the stored weight (steps of 1e-6 on weights of 0.1 are a few ulps).
        tol = 1e-4 * float(step.abs().max()) + 2 * torch.finfo(t.dtype).eps * float(t.abs().max())
        for name in ("tp2", "pp3"):
            diff = float((exported[name][n] - t - step).abs().max())
            if diff > tol:
                off.append(f"{name} {n}: {diff:.2e} of {float(step.abs().max()):.2e}")
    assert not off, f"{len(off)} tensor steps differ from TP=1's: " + "; ".join(off[:6])


def test_frozen_parts_and_vit_learning_rate(models, tmp_path: Path) -> None:
    """SGD without momentum: one step moves a parameter by -lr x grad. With the ViT and the
    projector frozen they stay bit for bit and the optimizer holds state for the LLM only; with
    --omnibal-vit-lr-mult 0.5 the ViT moves exactly half as far as with 1, the LLM as far."""
    built = models["internvl_300m"]
    ckpt = tmp_path / "converted"
    omnibal("convert", "hf-to-megatron", str(built.path), "--omnibal-vit-pp-layers", "4,0",
            "--omnibal-llm-pp-layers", "0,4", "--out", str(ckpt), "--no-progress")  # fmt: skip
    lengths = _lengths(tmp_path / "lengths.npz")
    common = ["--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "4,0",
              "--omnibal-llm-pp-layers", "0,4", "--optimizer", "sgd", "--sgd-momentum", "0",
              "--weight-decay", "0", "--train-iters", "1", "--save-interval", "1",
              "--ckpt-format", "torch"]  # fmt: skip
    runs = {
        "frozen": ["--omnibal-freeze", "vit,projector"],
        "full": [],
        "half": ["--omnibal-vit-lr-mult", "0.5"],
    }
    deltas = {}
    for name, flags in runs.items():
        out = tmp_path / name
        _train(out, built.path, ckpt, lengths, *common, *flags)
        back = tmp_path / f"{name}_hf"
        omnibal("convert", "megatron-to-hf", str(out), "--like", str(built.path), "--out",
                str(back), "--no-progress")  # fmt: skip
        exported = tensors(back)
        deltas[name] = {n: exported[n] - t for n, t in tensors(built.path).items()}
    vit = [n for n in deltas["full"] if n.startswith("vision_tower.")]
    proj = [n for n in deltas["full"] if n.startswith("multi_modal_projector.")]
    llm = [n for n in deltas["full"] if n.startswith("language_model.")]
    assert vit and proj and llm
    for n in vit + proj:
        assert not deltas["frozen"][n].any(), f"frozen {n} changed"
    assert any(deltas["frozen"][n].any() for n in llm)
    moved = [n for n in vit if deltas["full"][n].abs().max() > 1e-6]
    assert moved, "the ViT did not train"
    for n in moved:
        torch.testing.assert_close(deltas["half"][n], 0.5 * deltas["full"][n], rtol=1e-4,
                                   atol=1e-7)  # fmt: skip
    for n in llm:
        torch.testing.assert_close(deltas["half"][n], deltas["full"][n], rtol=1e-4, atol=1e-7)
    # Stage 0 holds the ViT, the projector and the LLM's word embedding: with the first two
    # frozen, its optimizer knows one parameter.
    state = torch.load(tmp_path / "frozen" / "iter_0000001" / "mp_rank_00_000" /
                       "model_optim_rng.pt", weights_only=False)  # fmt: skip
    groups = state["optimizer"]["param_groups"]
    assert sum(len(g["params"]) for g in groups) == 1, groups


def test_bad_input_names_the_problem(models, tmp_path: Path) -> None:
    built = models["internvl_300m"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    proc = omnibal("convert", "hf-to-megatron", str(bad), "--omnibal-vit-pp-layers", "4",
                   "--omnibal-llm-pp-layers", "4", "--out", str(tmp_path / "o1"), check=False)
    assert proc.returncode == 2 and "model_type 'qwen2_vl' is not supported" in proc.stderr
    # TP that does not split the LLM's 4 heads / 2 KV groups: the sizes that work are listed
    proc = omnibal("convert", "hf-to-megatron", str(built.path), "--tp", "3",
                   "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4",
                   "--out", str(tmp_path / "o2"), check=False)  # fmt: skip
    assert proc.returncode == 2 and "sizes that work: 1, 2, 4" in proc.stderr
    assert not (tmp_path / "o2").exists(), "the output was created before the check"
    # a missing shard, and a tensor of the wrong shape
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in built.path.iterdir():
        if f.suffix != ".safetensors":
            (sharded / f.name).write_bytes(f.read_bytes())
    sd = load_file(built.path / "model.safetensors")
    names = sorted(sd)
    half = len(names) // 2
    save_file({n: sd[n] for n in names[:half]}, str(sharded / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors"
                            for i, n in enumerate(names)}}  # fmt: skip
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = omnibal("convert", "hf-to-megatron", str(sharded), "--omnibal-vit-pp-layers", "4",
                   "--omnibal-llm-pp-layers", "4", "--out", str(tmp_path / "o3"), check=False)
    assert proc.returncode == 2 and "model-00002-of-00002.safetensors" in proc.stderr
    assert "missing" in proc.stderr
    wrong = dict(sd)
    key = "language_model.model.layers.1.mlp.down_proj.weight"
    wrong[key] = wrong[key][:, :-1].contiguous()
    save_file(wrong, str(sharded / "model.safetensors"))
    (sharded / "model.safetensors.index.json").unlink()
    (sharded / "model-00001-of-00002.safetensors").unlink()
    proc = omnibal("convert", "hf-to-megatron", str(sharded), "--omnibal-vit-pp-layers", "4",
                   "--omnibal-llm-pp-layers", "4", "--out", str(tmp_path / "o4"), check=False)
    assert proc.returncode == 2 and key in proc.stderr and "llm.layers.1.mlp.linear_fc2" in (
        proc.stderr)
    # a torch-format checkpoint compared at another layout
    ckpt = tmp_path / "ckpt"
    omnibal("convert", "hf-to-megatron", str(built.path), "--omnibal-vit-pp-layers", "4",
            "--omnibal-llm-pp-layers", "4", "--out", str(ckpt), "--no-progress")  # fmt: skip
    proc = omnibal("compare-hf", str(built.path), str(ckpt), "--omnibal-vit-pp-layers", "4,0",
                   "--omnibal-llm-pp-layers", "0,4", check=False)
    assert proc.returncode == 2 and "loads only at its own layout" in proc.stderr


def test_a_plan_with_virtual_stages_converts_and_exports_bit_for_bit(models, tmp_path: Path):
    """A plan of PP 2 x 2 chunks per rank (the ViT over the first chunks of both ranks): the
    torch format holds each rank's chunks as `model0`, `model1` in the rank's file, as
    megatron.training saves them; torch and torch_dist both export the original tensors, and
    transformers' forward equals the stages' (compare-hf: torch at its layout, one virtual
    stage per rank; torch_dist on one stage)."""
    from dataclasses import asdict, replace

    from megatron_omnibal.data.lengths import load_lengths
    from megatron_omnibal.megatron.stages.layout import layout_from_counts
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.plan_file.plan import StagePlan, save_plan
    from megatron_omnibal.planner.search.request import PlanRequest

    built = models["llava"]
    spec = read_hf(built.path).spec
    plan = make_plan(PlanRequest(model=spec, hardware=get_hardware("A100-80G"),
                                 lengths=load_lengths(_lengths(tmp_path / "lengths.npz")),
                                 gpus=2, tp=1, pp=2, vpp=2, global_batch=8))  # fmt: skip
    chunks = layout_from_counts([2, spec.vit.num_layers - 2, 0, 0], [0, 1, 2, 1],
                                vit_layers=spec.vit.num_layers, llm_layers=4)  # fmt: skip
    stages = tuple(StagePlan(**asdict(st), stage=v, forward_ms=1.0, backward_ms=1.0,
                             peak_memory_gib=1.0) for v, st in enumerate(chunks))  # fmt: skip
    save_plan(replace(plan, stages=stages), tmp_path / "plan.json")
    original = tensors(built.path)
    for fmt in ("torch", "torch_dist"):
        ckpt, back = tmp_path / fmt, tmp_path / f"{fmt}_hf"
        out = omnibal("convert", "hf-to-megatron", str(built.path), "--plan",
                      str(tmp_path / "plan.json"), "--ckpt-format", fmt, "--out", str(ckpt),
                      "--no-progress").stdout  # fmt: skip
        assert "TP 1 x PP 2 x 2 chunks" in out
        if fmt == "torch":
            files = sorted((ckpt / "release").rglob("*.pt"))
            assert [f.parent.name for f in files] == ["mp_rank_00_000", "mp_rank_00_001"]
            rank1 = torch.load(files[1], weights_only=False)
            assert {"model0", "model1"} <= set(rank1) and "model" not in rank1
            # rank 1's first chunk is virtual stage 1: ViT layers 2.. and the projector
            assert any(k.startswith("projector.") for k in rank1["model0"])
            assert not any(k.startswith("vit.") for k in rank1["model1"])
            # each virtual stage on a rank of its own, filled from its rank's chunk
            report = json.loads(omnibal("compare-hf", str(built.path), str(ckpt)).stdout)
            assert report["pp"] == 4 and report["llm_pp_layers"] == [0, 1, 2, 1]
        else:  # read by key at any layout: one stage
            report = json.loads(omnibal("compare-hf", str(built.path), str(ckpt),
                                        "--omnibal-vit-pp-layers", str(spec.vit.num_layers),
                                        "--omnibal-llm-pp-layers", "4").stdout)  # fmt: skip
            assert report["pp"] == 1
        assert report["ok"] and report["checkpoint_format"] == fmt
        assert max(report[k]["max_rel"] for k in ("logits", "vit", "llm")) <= 1e-4
        omnibal("convert", "megatron-to-hf", str(ckpt), "--like", str(built.path), "--out",
                str(back), "--no-progress")  # fmt: skip
        exported = tensors(back)
        assert sorted(exported) == sorted(original)
        for name, t in original.items():
            assert torch.equal(exported[name], t), (fmt, name)
