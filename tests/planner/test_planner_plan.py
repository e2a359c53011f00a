"""plan.json: making, validating, simulating; the commands; user model/GPU files; bad input."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.cli import main
from megatron_omnibal.data.lengths import from_arrays, load_lengths, save_lengths
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.resolve import resolve_model
from megatron_omnibal.planner.cost_model.config_files import resolve_hardware
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.plan import load_plan, save_plan
from megatron_omnibal.planner.search.baseline import same_parallel_baseline
from megatron_omnibal.planner.search.partition import NoFeasiblePartition
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import choose_partition, make_setting

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "internvl_subset.npz"


def request(model, hw, stats, gpus, tp=None, pp=None, **kw):
    """A PlanRequest with presets by name."""
    if isinstance(model, str):
        model = get_preset(model)
    if isinstance(hw, str):
        hw = get_hardware(hw)
    return PlanRequest(model=model, hardware=hw, lengths=stats, gpus=gpus, tp=tp, pp=pp, **kw)


@pytest.fixture(scope="module")
def stats():
    return load_lengths(EXAMPLE)


@pytest.fixture(scope="module")
def small_stats():
    rng = np.random.default_rng(0)
    vit = rng.integers(1, 4, 400)
    return from_arrays(vit, vit * 4 + rng.integers(20, 200, 400))


@pytest.fixture(scope="module")
def plan_6b20b(stats):
    return make_plan(
        request("internvl-6b-20b", "A100-80G", stats, 64, 1, 4, plan_path="p.json",
                lengths_path=str(EXAMPLE))  # fmt: skip
    )


def test_plan_is_valid_and_tiles_both_towers(plan_6b20b):
    plan = plan_6b20b
    par = plan.parallel
    assert (par.tp, par.pp, par.dp, par.gpus) == (1, 4, 16, 64)
    vit = [s.vit_layers for s in plan.stages]
    llm = [s.llm_layers for s in plan.stages]
    assert vit[0][0] == 0 and vit[-1][1] == 45 and llm[-1][1] == 48
    assert all(a[1] == b[0] for a, b in itertools.pairwise(vit)) and llm[0][0] == 0
    budget = 80.0 - 4.0
    assert all(s.peak_memory_gib <= budget + 1e-6 for s in plan.stages)
    flags = plan.megatron_flags
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == "4"
    assert flags[flags.index("--omnibal-plan") + 1] == "p.json"
    assert plan.data.num_samples == 70_706  # the shipped length file's samples
    assert plan.data.lengths_path == str(EXAMPLE)


def test_plan_beats_megatron_layout_on_the_same_batches(stats):
    """Oracle: the searched partition against Megatron's layout, same data and same simulator."""
    setting = make_setting(request("internvl-6b-20b", "A100-80G", stats, 64), 1, 4, 16, 16)
    searched, _ = choose_partition(setting, "exact")
    megatron, _ = choose_partition(setting, "megatron")
    assert (
        setting.predict(searched, setting.balanced).step_ms
        < setting.predict(megatron, setting.balanced).step_ms
    )
    # stage 0 of Megatron's layout holds all 45 ViT layers
    assert megatron.bounds[1] > 45
    part, result, _ = same_parallel_baseline(setting)
    assert part.bounds == megatron.bounds and result.step_ms > 0


def test_fixed_size_batches_are_padded_to_their_longest_sample(stats):
    """The baselines' micro-batches: count x longest tokens (and count x longest^2 attention),
    every real tile; checked against the drawn samples directly."""
    from megatron_omnibal.planner.search.setting import draw_batch

    req = request("internvl-6b-20b", "A100-80G", stats, 64, global_batch=96)
    setting = make_setting(req, 1, 4, 16, 2)
    index = draw_batch(req)
    for b, part in enumerate(np.array_split(index, 32)):
        longest = stats.tokens[part].max()
        want = [stats.vit[part].sum(), len(part) * longest, len(part) * longest**2, 1]
        assert setting.fixed.reshape(-1, 4)[b].tolist() == pytest.approx(want)


def test_less_memory_means_more_recompute(stats):
    model = get_preset("internvl-6b-20b")
    counts = []
    for hw in ("H200", "A100-80G"):
        setting = make_setting(request(model, hw, stats, 32), 1, 8, 4, 16)
        part, problem = choose_partition(setting, "exact")
        assert problem.fits(part)
        counts.append(sum(sum(r.values()) for r in part.recompute))
    assert counts[0] <= counts[1] and counts[1] > 0


def test_model_that_does_not_fit_names_stage_and_gib(stats):
    with pytest.raises(NoFeasiblePartition, match=r"stage [01] \(.*\) [0-9.]+ GiB short"):
        make_plan(request("internvl-6b-34b", "A100-40G", stats, 2, 1, 2))


def test_bad_parallel_sizes(small_stats):
    with pytest.raises(ValueError, match="--pp 10: must be between 1 and the 9 partition units"):
        request("tiny", "A100-80G", small_stats, 10, 1, 10)
    with pytest.raises(ValueError, match="--tp 3: must divide the attention heads"):
        request("tiny", "A100-80G", small_stats, 6, 3, 2)
    with pytest.raises(ValueError, match="not a multiple of tp x pp"):
        request("tiny", "A100-80G", small_stats, 6, 1, 4)
    with pytest.raises(ValueError, match="--global-batch must be a positive integer"):
        request("tiny", "A100-80G", small_stats, 2, global_batch=0)


def test_search_over_parallel_sizes_and_round_trip(tmp_path, small_stats):
    plan = make_plan(request("tiny", "H100-80G", small_stats, 8, global_batch=64))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert load_plan(path) == plan
    assert json.loads(path.read_text())["version"] == 2
    assert plan.parallel.tp * plan.parallel.pp * plan.parallel.dp == 8


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.pop("stages"), r"^bad.json: missing field 'stages'$"),
        (lambda p: p.__setitem__("version", 1), "version 1: this omnibal reads plan version 2"),
        (lambda p: p["stages"][1]["vit_layers"].__setitem__(0, 1),
         r"bad.json: stages\[1\].vit_layers \[1, \d+\] does not continue at layer \d+"),
        (lambda p: p["stages"][1].__setitem__("vit_layers", [1]),
         r"bad.json: stages\[1\].vit_layers: expected 2 values, got \[1\]"),
        (lambda p: p["stages"][2].__setitem__("head", "yes"),
         r"bad.json: stages\[2\].head: expected true or false, got 'yes'"),
        (lambda p: p["stages"][0].__setitem__("vit_recompute", 99),
         r"bad.json: stages\[0\]: vit_recompute 99: recompute counts must be within"),
        (lambda p: p["stages"][0].__setitem__("head", True),
         r"stages\[0\].head must be true on the last stage only"),
        (lambda p: p["stages"][0].__setitem__("layers", 3),
         r"bad.json: stages\[0\]: unknown field 'layers'"),
        (lambda p: p["parallel"].__setitem__("gpus", 7), r"bad.json: parallel: tp x pp x dp"),
        (lambda p: p["data"].__setitem__("num_samples", 0),
         r"bad.json: data: num_samples must be a positive integer, got 0"),
        (lambda p: p["data"].__setitem__("lengths_sha256", "abc"),
         r"bad.json: data: lengths_sha256 must be 64 lowercase hex digits"),
        (lambda p: p["model_spec"]["llm"].__setitem__("num_layers", 47),
         r"stages cover 45/45 ViT and 48/47 LLM layers|does not continue"),
        (lambda p: p["model_spec"]["vit"].pop("hidden_size"),
         r"bad.json: model_spec.vit: missing field\(s\) hidden_size"),
        (lambda p: p["hardware_spec"].__setitem__("memory_gib", "80"),
         r"bad.json: hardware_spec.memory_gib: expected a non-negative number"),
        (lambda p: p["stages"][0].__setitem__("peak_memory_gib", 200.0),
         r"stages\[0\].peak_memory_gib 200.0 exceeds the 76.000 GiB budget of A100-80G"),
        (lambda p: p["predicted"].__setitem__("speedup", 9.0),
         r"bad.json: predicted: speedup 9.0 is not baseline.step_ms / step_ms"),
        (lambda p: p["predicted"]["baseline"].__setitem__("peak_memory_gib", [90.0] * 4),
         r"predicted.baseline: a configuration over the memory budget is no baseline"),
        (lambda p: p["predicted"].__setitem__("baseline", None),
         r"bad.json: predicted: speedup without a baseline that fits memory"),
        (lambda p: p["predicted"].__setitem__("modeled", False), "modeled must be true"),
    ],
)  # fmt: skip
def test_load_plan_rejects_bad_plans_naming_the_field(tmp_path, plan_6b20b, mutate, message):
    doc = plan_6b20b.to_dict()
    assert doc["predicted"]["baseline"] is not None  # the baseline cases need one
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        load_plan(path, where="bad.json")


def test_plan_round_trips_through_json_exactly(tmp_path, plan_6b20b):
    path = tmp_path / "plan.json"
    save_plan(plan_6b20b, path)
    again = load_plan(path)
    assert again == plan_6b20b and again.to_dict() == plan_6b20b.to_dict()
    assert again.model_spec == get_preset("internvl-6b-20b")
    assert (tmp_path / "missing.json").exists() is False
    with pytest.raises(ValueError, match="missing.json: no such plan file"):
        load_plan(tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ValueError, match="text.json: not a JSON plan"):
        load_plan(tmp_path / "text.json")


def test_user_model_and_gpu_files(tmp_path):
    spec = get_preset("llava-1.5-7b").to_dict()
    (tmp_path / "m.json").write_text(json.dumps(spec))
    model = resolve_model(str(tmp_path / "m.json"))
    assert (
        model.to_dict() == spec
        and model.llm.layer_params == get_preset("llava-1.5-7b").llm.layer_params
    )
    (tmp_path / "gpu.yaml").write_text(
        "name: MyGPU\npeak_tflops: 500\nmemory_gib: 48\nnvlink_gbs: 200\nnetwork_gbs: 25\n"
    )
    assert resolve_hardware(str(tmp_path / "gpu.yaml")).memory_gib == 48.0
    (tmp_path / "bad.yaml").write_text("name: x\npeak_tflops: fast\n")
    with pytest.raises(ValueError, match=r"bad.yaml\.peak_tflops: expected a non-negative"):
        resolve_hardware(str(tmp_path / "bad.yaml"))
    spec["llm"]["num_layerz"] = 3
    (tmp_path / "typo.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"typo.json\.llm: unknown field 'num_layerz'"):
        resolve_model(str(tmp_path / "typo.json"))


def test_partition_command_matches_brute_force(tmp_path, capsys):
    rng = np.random.default_rng(3)
    layers = [
        {
            "name": f"l{i}",
            "forward_ms": float(f),
            "backward_ms": float(2 * f),
            "activation_mib": 100.0,
            "weight_mib": 10.0,
        }
        for i, f in enumerate(rng.uniform(1, 3, 9))
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"micro_batches": 8, "layers": layers, "p2p_ms": 0.1}))
    assert main(["partition", "--profile", str(path), "--pp", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stages"][0][0] == 0 and out["stages"][-1][1] == 9
    assert all(a[1] == b[0] for a, b in itertools.pairwise(out["stages"]))
    from megatron_omnibal.planner.simulator.simulate import simulate

    f = np.array([x["forward_ms"] for x in layers])
    best = min(
        simulate(
            np.repeat([[f[:a].sum()], [f[a:b].sum()], [f[b:].sum()]], 8, 1),
            np.repeat([[2 * f[:a].sum()], [2 * f[a:b].sum()], [2 * f[b:].sum()]], 8, 1),
            3,
            1,
            0.1,
        ).makespan_ms
        for a in range(1, 8)
        for b in range(a + 1, 9)
    )
    assert best - 1e-5 <= out["step_ms"] <= best * 1.005
    assert main(["partition", "--profile", str(path), "--pp", "12"]) == 2
    assert "pipeline size 12 is larger than the 9" in capsys.readouterr().err


def test_recompute_measured_as_zero_is_floored_and_not_chosen(tmp_path, capsys):
    """`omnibal profile` can measure recompute as ~0 ms (checkpointed minus plain fwd+bwd, in
    noise): it is floored at the layer's forward (recomputation re-runs it), and with unlimited
    memory no layer is recomputed."""
    from megatron_omnibal.planner.cost_model.costs import load_profile

    rng = np.random.default_rng(5)
    layers = [
        {"name": f"l{i}", "forward_ms": float(f), "backward_ms": float(2 * f),
         "recompute_ms": 0.0 if i != 3 else 9.0, "activation_mib": 100.0 + i,
         "checkpoint_mib": 5.0, "weight_mib": 10.0, "group": "vit" if i < 4 else "llm"}
        for i, f in enumerate(rng.uniform(1, 3, 8))
    ]  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"micro_batches": 4, "layers": layers}))
    costs, _ = load_profile(path)
    want = [9.0 if i == 3 else x["forward_ms"] for i, x in enumerate(layers)]
    assert costs.recompute_ms.tolist() == pytest.approx(want)
    assert main(["partition", "--profile", str(path), "--pp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recompute"] == [0, 0]


def test_partition_command_is_optimal_with_few_micro_batches(tmp_path, capsys):
    """Fewer micro-batches (2) than stages (5), backward 0.3x..4x forward per layer: the
    command's step equals the best of every split simulated, and it proves its gap. (With this
    seed the DPs + polish alone end 6.0% above the optimum.)"""
    from megatron_omnibal.planner.simulator.simulate import simulate

    rng = np.random.default_rng(50)
    f = rng.uniform(0.5, 3, 10)
    b = f * rng.uniform(0.3, 4, 10)
    layers = [
        {
            "name": f"l{i}",
            "forward_ms": float(f[i]),
            "backward_ms": float(b[i]),
            "activation_mib": 100.0,
            "weight_mib": 10.0,
        }
        for i in range(10)
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"micro_batches": 2, "layers": layers, "p2p_ms": 0.2}))
    assert main(["partition", "--profile", str(path), "--pp", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)

    def step(bounds):
        seg = list(itertools.pairwise(bounds))
        fw = np.array([[f[lo:hi].sum()] * 2 for lo, hi in seg])
        bw = np.array([[b[lo:hi].sum()] * 2 for lo, hi in seg])
        return simulate(fw, bw, 5, 1, 0.2).makespan_ms

    best = min(step((0, *cuts, 10)) for cuts in itertools.combinations(range(1, 10), 4))
    assert out["step_ms"] == pytest.approx(best, rel=1e-6)
    assert out["lower_bound_ms"] <= best + 1e-5  # rounded to 6 decimals in the JSON
    assert 0 <= out["proven_gap"] <= 1e-3


def _step(text: str) -> float:
    return float(text.split("step ")[1].split()[0])


def test_plan_and_simulate_commands(tmp_path, capsys, small_stats):
    """`simulate` replays the plan, its baseline and the same-sizes layout on the length file
    the plan recorded, and reproduces the plan's own predictions."""
    lengths = tmp_path / "lengths.npz"
    save_lengths(small_stats, lengths)
    out, png = tmp_path / "plan.json", tmp_path / "gantt.png"
    argv = ["plan", "--model", "tiny", "--hardware", "A100-80G", "--gpus", "4", "--pp", "2",
            "--global-batch", "64", "--lengths", str(lengths), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("modeled speedup") and "megatron flags" in text
    plan = load_plan(out)
    assert plan.data.lengths_path == str(lengths.resolve())
    assert main(["simulate", "--plan", str(out), "--png", str(png)]) == 0
    assert _step(capsys.readouterr().out) == pytest.approx(plan.predicted.step_ms, rel=1e-4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--plan", str(out), "--baseline"]) == 0
    base = _step(capsys.readouterr().out)
    assert base == pytest.approx(plan.predicted.baseline.step_ms, rel=1e-4)
    assert main(["simulate", "--plan", str(out), "--baseline", "same-parallel"]) == 0
    same = _step(capsys.readouterr().out)
    assert same == pytest.approx(plan.predicted.same_parallel.step_ms, rel=1e-4)
    # The same lengths in another format match (the digest is of the lengths, not the bytes).
    as_json = tmp_path / "lengths.json"
    records = [
        {"vit_num": int(v), "token_num": int(t), "image_flags": int(f)}
        for v, t, f in zip(
            small_stats.vit, small_stats.tokens, small_stats.image_flags, strict=True
        )
    ]
    as_json.write_text(json.dumps(records))
    assert main(["simulate", "--plan", str(out), "--lengths", str(as_json)]) == 0
    assert _step(capsys.readouterr().out) == pytest.approx(plan.predicted.step_ms, rel=1e-4)
    # Changed, moved or never-named data is refused, naming the file.
    save_lengths(small_stats.subset(np.arange(len(small_stats) - 1)), lengths)
    assert main(["simulate", "--plan", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"was made from other lengths than {lengths.resolve()} now holds" in err
    lengths.unlink()
    assert main(["simulate", "--plan", str(out)]) == 2
    assert f"the length file {lengths.resolve()}, which does not exist" in capsys.readouterr().err
    assert main(["plan", "--model", "nope", "--hardware", "A100-80G", "--gpus", "4",
                 "--lengths", "example", "--out", str(out)]) == 2  # fmt: skip
    assert "unknown model preset 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "2"],
         "the following arguments are required: --lengths"),
        (["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "0", "--lengths", "example"],
         "argument --gpus: must be a positive integer, got 0"),
        (["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "2", "--lengths", "example",
          "--global-batch", "-3"], "argument --global-batch: must be a positive integer"),
        (["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "2", "--lengths", "example",
          "--seed", "-1"], "argument --seed: must be >= 0"),
        (["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "2", "--lengths", "example",
          "--micro-batches", "x"], "argument --micro-batches: expected an integer, got 'x'"),
        (["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "2", "--lengths", "example",
          "--out", "/no/such/dir/p.json"], "argument --out: /no/such/dir/p.json: directory"),
        (["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "2", "--lengths", "example",
          "--out", "."], "argument --out: . is a directory"),
        (["simulate", "--plan", "p.json", "--png", "/no/such/dir/g.png"],
         "argument --png: /no/such/dir/g.png: directory"),
        (["simulate", "--plan", "p.json", "--seed", "-2"], "argument --seed: must be >= 0"),
        (["partition", "--profile", "x.json", "--pp", "0"], "argument --pp: must be a positive"),
        (["partition", "--profile", "x.json", "--pp", "2", "--memory-gib", "-1"],
         "argument --memory-gib: must be > 0"),
        (["partition", "--profile", "x.json", "--pp", "2", "--memory-gib", "nan"],
         "argument --memory-gib: expected a finite number"),
        (["profile", "--tiles", "0"], "argument --tiles: must be a positive integer"),
        (["profile", "--repeats", "0"], "argument --repeats: must be a positive integer"),
        (["profile", "--micro-batches", "-1"], "argument --micro-batches: must be a positive"),
        (["profile", "--memory-gib", "0"], "argument --memory-gib: must be > 0"),
        (["profile", "--out", "/no/such/dir/p.json"], "argument --out: /no/such/dir/p.json"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_naming_the_flag_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_example_lengths_only_by_name(tmp_path, capsys):
    """No silent fallback: `--lengths example` is the shipped subset, and a file named
    'example' elsewhere is not."""
    out = tmp_path / "p.json"
    argv = ["plan", "--model", "tiny", "--hardware", "H200", "--gpus", "2", "--pp", "2",
            "--global-batch", "32", "--out", str(out)]  # fmt: skip
    assert main([*argv, "--lengths", "example"]) == 0
    assert load_plan(out).data.lengths_path == str(EXAMPLE.resolve())
    assert main([*argv, "--lengths", str(tmp_path / "nope.npz")]) == 2
    assert f"--lengths {tmp_path / 'nope.npz'}: " in capsys.readouterr().err


def test_cli_entry_point_runs_as_a_process(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "megatron_omnibal.cli", "plan", "--model", "tiny", "--hardware",
         "H200", "--gpus", "2", "--pp", "2", "--global-batch", "32", "--lengths", "example",
         "--out", str(tmp_path / "p.json"), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(res.stdout)["parallel"]["pp"] == 2


def test_plans_are_accepted_by_the_megatron_layout(stats):
    """Contract with the Megatron side: its (pure Python) layout reader takes our stages."""
    from megatron_omnibal.megatron.stages.layout import layout_from_plan

    for name, gpus, pp in (("internvl-6b-20b", 64, 8), ("llava-1.5-7b", 16, 4)):
        plan = make_plan(request(name, "A100-80G", stats, gpus, None, pp))
        layout = layout_from_plan(plan, pp)
        assert [s.vit_layers for s in layout] == [s.vit_layers for s in plan.stages]
        assert [s.llm_recompute for s in layout] == [s.llm_recompute for s in plan.stages]


def test_plan_from_a_measured_profile(tmp_path, capsys, small_stats):
    from megatron_omnibal.planner.cost_model.costs import (
        analytic_costs,
        costs_to_profile,
        workload_features,
    )

    tiny, hw = get_preset("tiny"), get_hardware("A100-80G")
    doc = costs_to_profile(analytic_costs(tiny, hw).at(workload_features(4, 256, 0)), 8)
    doc["measured"] = {"tiles": 4, "tokens": 256}
    plan = make_plan(request(tiny, hw, small_stats, 4, None, 2, global_batch=64, profile=doc))
    assert plan.predicted.cost_model == "measured profile" and plan.parallel.tp == 1
    assert plan.predicted.baseline.tp == 1  # the baseline is searched at the profile's TP too
    with pytest.raises(ValueError, match="a measured profile is for TP = 1"):
        request(tiny, hw, small_stats, 4, 2, 2, global_batch=64, profile=doc)
    # Through the commands: simulate re-reads the profile the plan recorded.
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    lengths, out = tmp_path / "lengths.npz", tmp_path / "plan.json"
    save_lengths(small_stats, lengths)
    assert main(["plan", "--model", "tiny", "--hardware", "A100-80G", "--gpus", "4", "--pp", "2",
                 "--global-batch", "64", "--lengths", str(lengths), "--profile",
                 str(tmp_path / "profile.json"), "--out", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out)]) == 0
    step = _step(capsys.readouterr().out)
    assert step == pytest.approx(load_plan(out).predicted.step_ms, rel=1e-4)
    doc["layers"][0]["forward_ms"] *= 2
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    assert main(["simulate", "--plan", str(out)]) == 2
    assert "was made from another layer profile than" in capsys.readouterr().err
    doc["layers"] = doc["layers"][:-1]
    with pytest.raises(ValueError, match="profile has 8 layers, tiny has 9 partition units"):
        make_plan(request(tiny, hw, small_stats, 4, None, 2, global_batch=64, profile=doc))
