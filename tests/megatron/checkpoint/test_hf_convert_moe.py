"""Mixture-of-experts checkpoints (InternVL3.5-30B-A3B's layouts and Qwen3-VL-30B-A3B's, tiny: a
Qwen3-MoE LLM of 3 layers with 4 experts, top 2) through `omnibal convert` and `omnibal
compare-hf` at expert parallelism, and loaded into the stages at EP=2 against transformers'
forward.

- compare-hf: converted to torch_dist in TP x PP x EP processes at EP=2 with an uneven PP=2 (the
  ViT over both stages, every LLM layer on the second), run there: transformers' forward of the
  HF checkpoint equals the stages' within 1e-4; the export gives the original tensors bit for bit.
- torch format at TP=2 x PP=2 x EP=2: one file per rank as megatron.training names them, each
  with its own experts under local indices; exported bit for bit under the original names, for
  transformers' `internvl` layout and OpenGVLab's `internvl_chat` one; Qwen3-VL-MoE's fused
  experts from the hub's orientation and from the one transformers 5 saves, both exported in
  the hub's.
- the OpenGVLab layout (remote code only; against transformers' forward of its
  transformers-format twin) and Qwen3-VL-MoE (fused experts in the hub's orientation) loaded
  into the stages at PP=2 x EP=2 (uneven, the ViT over both stages) and TP=2 x EP=2.
- bad input: an EP that does not divide the experts, EP on a dense LLM, a torch-format
  checkpoint run at another EP: refused naming the flag.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_models
from tests.megatron.checkpoint.test_hf_convert import omnibal, tensors

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402

WORKER = Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers" / "hf_worker.py"
UNEVEN = ["--omnibal-vit-pp-layers", "3,1", "--omnibal-llm-pp-layers", "0,3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, hf_models.Built]:
    root = tmp_path_factory.mktemp("moe")
    return {
        "internvl": hf_models.internvl(root / "internvl", six_b=False, text="qwen3_moe",
                                       llm_layers=3),
        "chat": hf_models.internvl_chat(root / "chat", text="qwen3_moe", six_b=False,
                                        llm_layers=3),
        "qwen3_vl_moe": hf_models.qwen3_vl_moe(root / "qwen3_vl_moe"),
        "qwen3_vl_moe_saved": hf_models.qwen3_vl_moe(root / "qwen3_vl_moe_saved", hub=False),
    }  # fmt: skip


def _same_tensors(original: Path, exported: Path) -> None:
    want, got = tensors(original), tensors(exported)
    assert sorted(got) == sorted(want)
    assert any(".mlp.experts.3.down_proj." in n or n.endswith(".mlp.experts.down_proj")
               for n in want)  # fmt: skip
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_compare_hf_at_ep2_uneven_pp2_and_export(models, tmp_path: Path) -> None:
    built = models["internvl"]
    ckpt, back = tmp_path / "dist", tmp_path / "hf"
    out = omnibal("convert", "hf-to-megatron", str(built.path), "--ep", "2", *UNEVEN,
                  "--ckpt-format", "torch_dist", "--out", str(ckpt), "--no-progress").stdout
    assert "TP 1 x PP 2 x EP 2" in out
    report = json.loads(omnibal("compare-hf", str(built.path), str(ckpt)).stdout)
    assert report["ok"] and (report["pp"], report["ep"]) == (2, 2), report
    assert report["vit_pp_layers"] == [3, 1] and report["llm_pp_layers"] == [0, 3]
    assert max(report[k]["max_rel"] for k in ("logits", "vit", "llm")) <= 1e-4, report
    omnibal("convert", "megatron-to-hf", str(ckpt), "--like", str(built.path), "--out",
            str(back), "--no-progress")  # fmt: skip
    _same_tensors(built.path, back)
    from transformers import AutoModelForImageTextToText

    _, info = AutoModelForImageTextToText.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("layout", ["internvl", "chat", "qwen3_vl_moe", "qwen3_vl_moe_saved"])
def test_torch_format_tp2_pp2_ep2_round_trip(models, layout: str, tmp_path: Path) -> None:
    """Qwen3-VL-MoE: the saved orientation is read and the hub's written (its original)."""
    built = models[layout]
    ckpt, back = tmp_path / "torch", tmp_path / "hf"
    omnibal("convert", "hf-to-megatron", str(built.path), "--tp", "2", "--ep", "2",
            "--omnibal-vit-pp-layers", "4,0", "--omnibal-llm-pp-layers", "1,2",
            "--out", str(ckpt), "--no-progress")  # fmt: skip
    dirs = sorted(p.parent.name for p in (ckpt / "release").rglob("model_optim_rng.pt"))
    assert dirs == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2)
                    for e in range(2)]  # fmt: skip
    # EP rank 1 of stage 1 (LLM layers 1, 2: local 0, 1) holds experts 2, 3 as local 0, 1
    ep0, ep1 = (torch.load(ckpt / "release" / f"mp_rank_01_001_00{e}" / "model_optim_rng.pt",
                           weights_only=False)["model"] for e in (0, 1))  # fmt: skip
    experts = [k for k in ep1 if ".local_experts." in k and k.endswith(".weight")]
    assert sorted({k.split(".local_experts.")[1].split(".")[0] for k in experts}) == ["0", "1"]
    assert {k for k in ep0 if ".local_experts." not in k} == {
        k for k in ep1 if ".local_experts." not in k}
    from safetensors.torch import load_file

    hf = load_file(models["qwen3_vl_moe" if "qwen3" in layout else layout].path /
                   "model.safetensors")  # fmt: skip
    down = (hf["model.language_model.layers.2.mlp.experts.down_proj"][3].T if "qwen3" in layout
            else hf["language_model.model.layers.2.mlp.experts.3.down_proj.weight"])  # fmt: skip
    # TP rank 1's half of expert 3's fc2 (row-parallel: columns split), layer 2 = local 1
    assert torch.equal(ep1["llm.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                       down.chunk(2, dim=1)[1])  # fmt: skip
    omnibal("convert", "megatron-to-hf", str(ckpt), "--like", str(built.path), "--out",
            str(back), "--no-progress")  # fmt: skip
    _same_tensors(models["qwen3_vl_moe"].path if "qwen3" in layout else built.path, back)


def test_loaded_at_ep2_against_transformers(models, tmp_path: Path) -> None:
    """internvl_chat's and Qwen3-VL-MoE's tensors through the package's mapping into the
    stages at PP=2 x EP=2 (uneven) and TP=2 x EP=2, against transformers' forward (of the
    twin internvl_chat's were made from), one launch for both."""
    from megatron_omnibal.megatron.compare.probe import probe_samples
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.models.hf_reference import reference

    refs, entries = {}, {}
    for name in ("chat", "qwen3_vl_moe"):
        built = models[name]
        hf = read_hf(built.path)
        batch = probe_samples(hf.spec)
        torch.save([asdict(s) for s in batch], tmp_path / f"{name}.batch.pt")
        refs[name] = (reference(built.model, hf, batch), batch, hf.spec.vit.native_resolution)
        entries[name] = {"hf_dir": str(built.path), "batch": str(tmp_path / f"{name}.batch.pt")}
    cases = [
        {"name": "pp2_ep2", "tp": 1, "pp": 2, "ep": 2, "vit": [3, 1], "llm": [0, 3]},
        {"name": "tp2_ep2", "tp": 2, "pp": 1, "ep": 2, "vit": [4], "llm": [3]},
    ]
    cfg = tmp_path / "cases.json"
    cfg.write_text(json.dumps({"models": entries, "cases": cases}))
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = run_ranks(WORKER, 4, [str(cfg), str(out)], timeout=600)
    assert code == 0, stdout[-3000:] + stderr[-6000:]
    for (name, (ref, batch, native)), case in ((r, c) for r in refs.items() for c in cases):
        got: dict[str, torch.Tensor] = {}
        for f in sorted(out.glob(f"{name}.{case['name']}.stage*.pt")):
            got.update(torch.load(f))
        flags = torch.cat([s.image_flags for s in batch]).bool()
        vit = got["vit"] if native else got["vit"][flags]  # native: the patches
        for key, mine in (("logits", got["logits"]), ("llm", got["llm"]), ("vit", vit)):
            rel = float((mine - ref[key]).abs().max() / ref[key].abs().max())
            assert rel <= 1e-4, (name, case["name"], key, rel)


def test_bad_expert_parallel_sizes_are_refused(models, tmp_path: Path) -> None:
    built = models["internvl"]
    proc = omnibal("convert", "hf-to-megatron", str(built.path), "--ep", "3", *UNEVEN,
                   "--out", str(tmp_path / "o1"), check=False)  # fmt: skip
    assert proc.returncode == 2 and "--ep: expert parallel size 3 does not divide the LLM's 4 " \
        "experts" in proc.stderr and "sizes that work: 1, 2, 4" in proc.stderr
    assert not (tmp_path / "o1").exists(), "the output was created before the check"
    dense = hf_models.internvl(tmp_path / "dense", six_b=False, text="qwen3", llm_layers=2)
    proc = omnibal("convert", "hf-to-megatron", str(dense.path), "--ep", "2",
                   "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "2",
                   "--out", str(tmp_path / "o2"), check=False)  # fmt: skip
    assert proc.returncode == 2 and "--ep: expert parallel size 2: the LLM has no experts" in (
        proc.stderr)
    ckpt = tmp_path / "ckpt"
    omnibal("convert", "hf-to-megatron", str(built.path), "--ep", "2", "--omnibal-vit-pp-layers",
            "4", "--omnibal-llm-pp-layers", "3", "--out", str(ckpt), "--no-progress")
    proc = omnibal("compare-hf", str(built.path), str(ckpt), "--ep", "1", check=False)
    assert proc.returncode == 2 and "loads only at its own layout" in proc.stderr
    assert "EP 2 as written" in proc.stderr
