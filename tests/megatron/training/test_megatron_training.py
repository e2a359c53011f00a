"""Real training through `megatron_omnibal.pretrain_vlm` (torchrun, gloo, several processes):
resume after a stop gives the losses of an uninterrupted run, DP ranks read every sample
exactly once per epoch, and bad input stops every rank with a clear error before any process
group exists."""

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.lengths import load_lengths
from tests.helpers.dp_runs import dp_epoch_steps
from tests.helpers.dp_runs import tiny_training_flags as _flags

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_local, run_ranks  # noqa: E402
from run_records import assert_same_grads  # noqa: E402
from run_records import records as _records  # noqa: E402
from run_records import step_grads as _grads  # noqa: E402

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "train_record.py"
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"


def _torchrun(nproc, out, flags, timeout=240, torchrun=False):
    """The worker on local ranks (launch.py run_ranks), or under real torchrun."""
    code, stdout, stderr = run_ranks(WORKER, nproc, [out, *flags], timeout, torchrun=torchrun)
    return subprocess.CompletedProcess([WORKER, out, *flags], code, stdout, stderr)


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_resume_after_stop_continues_with_the_uninterrupted_losses(lengths_file, tmp_path):
    """PP=2 with a stage-1 recompute and dropout: run `total` steps; stop a second run after
    `stop` (--exit-interval saves and exits), resume it from the checkpoint to `total`: the
    resumed steps read the same samples and give the same per-micro-batch losses (optimizer, LR
    schedule, RNG and data position all restored). `stop` lies in the sampler's second epoch."""
    stop = dp_epoch_steps(lengths_file, dp=1) + 1
    total = stop + 2
    common = _flags(lengths_file, "--pipeline-model-parallel-size", "2",
                    "--omnibal-vit-pp-layers", "4,0", "--omnibal-llm-pp-layers", "1,3",
                    "--omnibal-llm-recompute", "0,2", "--global-batch-size", "2",
                    "--train-iters", str(total))  # fmt: skip
    ckpt = tmp_path / "ckpt"
    _ok(_torchrun(2, tmp_path / "whole", common))
    _ok(_torchrun(2, tmp_path / "stopped", [*common, "--save", str(ckpt), "--save-interval",
                                            "1000", "--exit-interval", str(stop)]))  # fmt: skip
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stop)
    _ok(_torchrun(2, tmp_path / "resumed", [*common, "--load", str(ckpt)]))

    whole, stopped, resumed = (_records(tmp_path / n) for n in ("whole", "stopped", "resumed"))
    k = 2 * stop  # micro-batches before the stop
    for rank in (0, 1):
        assert stopped[rank]["start"] == 0 and resumed[rank]["start"] == stop
        w, s, r = whole[rank]["micro"], stopped[rank]["micro"], resumed[rank]["micro"]
        assert len(w) == 2 * total and len(s) == k and len(r) == 2 * total - k
        assert [m["indices"] for m in s + r] == [m["indices"] for m in w]
    last = 1  # the head stage computes the losses
    w, s, r = whole[last]["micro"], stopped[last]["micro"], resumed[last]["micro"]
    assert sum(m["tokens"] for m in r) > 0
    assert [m["tokens"] for m in r] == [m["tokens"] for m in w[k:]]
    assert [m["loss"] for m in s] == pytest.approx([m["loss"] for m in w[:k]], rel=1e-6)
    assert [m["loss"] for m in r] == pytest.approx([m["loss"] for m in w[k:]], rel=1e-6)


def test_data_parallel_ranks_train_each_sample_once_per_epoch(lengths_file, dp2_run):
    """DP=2 (PP=1, conftest's dp2_run): over one epoch of real training steps the two ranks'
    micro-batches hold every sample exactly once, and each rank's loss counts exactly its
    samples' loss tokens."""
    records = dp2_run.records
    assert sorted(r["dp_rank"] for r in records.values()) == [0, 1]
    seen = Counter(i for r in records.values() for m in r["micro"] for i in m["indices"])
    assert sorted(seen) == list(range(40)) and max(seen.values()) == 1
    from megatron_omnibal.megatron.stream.batch import synthetic_sample
    from megatron_omnibal.megatron.stream.data import model_lengths
    from megatron_omnibal.models.presets import PRESETS

    spec = PRESETS["tiny"]
    data = model_lengths(load_lengths(lengths_file), 256, spec.tokens_per_tile, 8)
    for r in records.values():
        for m in r["micro"]:
            want = sum(int((synthetic_sample(i, data, spec, 7).labels >= 0).sum())
                       for i in m["indices"])  # fmt: skip
            assert m["tokens"] == want


def test_data_parallel_resume_with_dropout_continues_with_the_uninterrupted_losses(
    dp2_run, tmp_path
):
    """DP=2 with dropout: resuming from the checkpoint two steps before the end gives both ranks
    the uninterrupted run's samples and losses. The ranks' micro-batches differ in shape, so
    their dropout RNG streams diverge; each must resume with its own RNG state (rank 1 would
    differ on the first resumed step) and the all-reduced update must match (both ranks on the
    second)."""
    flags, stop = dp2_run.flags, dp2_run.stop
    _ok(_torchrun(2, tmp_path / "resumed", [*flags, "--load", str(dp2_run.ckpt), "--ckpt-step",
                                            str(stop)]))  # fmt: skip
    w, r = dp2_run.records, _records(tmp_path / "resumed")
    for rank in (0, 1):
        assert r[rank]["start"] == stop
        tail = w[rank]["micro"][2 * stop :]
        got = r[rank]["micro"]
        assert len(got) == len(tail) == 4
        assert [m["indices"] for m in got] == [m["indices"] for m in tail]
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in tail], rel=1e-6)


def test_bad_layout_stops_both_torchrun_ranks_once_without_a_traceback(lengths_file, tmp_path):
    """Under torchrun every rank refuses the layout itself and exits non-zero; nobody waits in
    a collective. Rank 0 alone prints the error, once, with no traceback, before Megatron's
    argument dump (tests/megatron/flags/test_megatron_training_args.py covers the other bad
    inputs)."""
    flags = _flags(lengths_file, "--pipeline-model-parallel-size", "2", "--global-batch-size",
                   "2", "--train-iters", "2", "--omnibal-vit-pp-layers", "4,0",
                   "--omnibal-llm-pp-layers", "1,2")  # fmt: skip
    proc = _torchrun(2, tmp_path / "bad", flags, timeout=90, torchrun=True)
    assert proc.returncode != 0
    message = "pretrain_vlm: error: pipeline layout: llm layers add up to 3 over 2 stages"
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert proc.stderr.count("pretrain_vlm: error:") == 1
    # torchrun's own report of the failed ranks is the only traceback
    assert proc.stderr.count("Traceback") == proc.stderr.count("ChildFailedError:") == 1
    assert "exitcode  : 2" in proc.stderr  # torchrun's report of the ranks' status
    assert "arguments" not in proc.stdout and "initializing torch distributed" not in proc.stdout
    assert not list((tmp_path / "bad").glob("rank*.json"))


# Packing levels: the short level runs 4 micro-batches per step, the top level (the budgets) the
# run's 2; in the PP=2 plan each level recomputes other layers on each stage.
LEVELS = "6/64x4,16/160"
VIT, LLM = (3, 1), (0, 4)  # layers per stage: stage 1 holds the ViT's last layer and the LLM
RECOMPUTE = {0: ((1, 0), (0, 1)), 1: ((3, 1), (0, 3))}  # level: (vit per stage, llm per stage)


def _levels_plan(path, lengths_file):
    """A real `omnibal plan` plan for tiny at PP=2 on the lengths, with the test's split, the
    run's budgets and the levels above (their recompute set here, not fitted)."""
    from dataclasses import replace

    from megatron_omnibal.balance.config import Level
    from megatron_omnibal.models.presets import get_preset
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.plan_file.plan import LevelPrediction, StagePlan, save_plan
    from megatron_omnibal.planner.search.request import PlanRequest

    plan = make_plan(PlanRequest(model=get_preset("tiny"), hardware=get_hardware("A100-80G"),
                                 lengths=load_lengths(lengths_file), gpus=2, tp=1, pp=2,
                                 micro_batches=2, global_batch=8))  # fmt: skip
    stages = tuple(
        StagePlan(stage=s, vit_layers=(sum(VIT[:s]), sum(VIT[: s + 1])),
                  llm_layers=(sum(LLM[:s]), sum(LLM[: s + 1])), patch_embed=s == 0,
                  projector=s == 1, llm_embed=s == 1, head=s == 1, forward_ms=1.0,
                  backward_ms=1.0, peak_memory_gib=1.0)
        for s in range(2))  # fmt: skip
    levels = tuple(
        replace(Level.parse(text, 2), vit_recompute=RECOMPUTE[i][0],
                llm_recompute=RECOMPUTE[i][1])
        for i, text in enumerate(LEVELS.split(",")))  # fmt: skip
    predicted = LevelPrediction(step_ms=1.0, samples=1, steps=1, peak_memory_gib=(1.0, 1.0))
    plan = replace(plan, stages=stages,
                   data=replace(plan.data, vit_budget=16, token_budget=160, pack_cost=None,
                                levels=levels),
                   predicted=replace(plan.predicted, levels=(predicted, predicted)))  # fmt: skip
    save_plan(plan, path)
    return str(path)


def _level_run(nproc, out, flags):
    env = {**os.environ, "OMNIBAL_TEST_WEIGHTS": "11", "OMNIBAL_TEST_GRADS": "1"}
    proc = run_local(nproc, [WORKER, out, *flags], 300, env)
    _ok(proc)
    (out / "stdout.txt").write_text(proc.stdout)
    return _records(out)


@pytest.fixture(scope="module")
def level_runs(lengths_file, tmp_path_factory):
    """PP=1 without recompute (the oracle) and PP=2 from the levels plan, 7 steps each from the
    same weights; then the PP=2 run stopped after step 5 (the last step of a stretch of the
    short level) and resumed (its first step is of the top level)."""
    out = tmp_path_factory.mktemp("levels")
    total, stop = 7, 5
    common = _flags(lengths_file, "--global-batch-size", "2", "--train-iters", str(total),
                    "--hidden-dropout", "0", "--attention-dropout", "0")  # fmt: skip
    pp1 = [*common, "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4",
           "--omnibal-levels", LEVELS]  # fmt: skip
    pp2 = [*common, "--pipeline-model-parallel-size", "2", "--omnibal-precision", "fp32",
           "--omnibal-plan", _levels_plan(out / "plan.json", lengths_file)]  # fmt: skip
    ckpt = out / "ckpt"
    runs = {
        "pp1": _level_run(1, out / "pp1", pp1),
        "pp2": _level_run(2, out / "pp2", pp2),
        "stopped": _level_run(2, out / "stopped", [*pp2, "--save", str(ckpt), "--save-interval",
                                                   "1000", "--exit-interval", str(stop)]),
        "resumed": _level_run(2, out / "resumed", [*pp2, "--load", str(ckpt)]),
    }  # fmt: skip
    return out, runs, total, stop


def _steps_of(micro):
    """Micro-batch records grouped into steps by their level's count (4 or 2)."""
    steps, i = [], 0
    while i < len(micro):
        n = 4 if micro[i]["level"] == 0 else 2
        steps.append(micro[i : i + n])
        i += n
    return steps


def test_levels_pp2_with_per_level_recompute_equals_pp1(level_runs):
    """Oracle: the PP=1 run without recompute. Every step runs its level's micro-batches (both
    levels occur), all micro-batches read the same samples, and the PP=2 run's losses and every
    gradient each optimizer step applies equal PP=1's within 1e-5."""
    out, runs, total, _ = level_runs
    pp1, pp2 = runs["pp1"][0]["micro"], runs["pp2"][1]["micro"]
    steps = _steps_of(pp1)
    assert len(steps) == total and {s[0]["level"] for s in steps} == {0, 1}
    assert all(len({m["level"] for m in s}) == 1 for s in steps)
    for rank in (0, 1):
        assert [m["indices"] for m in runs["pp2"][rank]["micro"]] == [m["indices"] for m in pp1]
        assert [m["level"] for m in runs["pp2"][rank]["micro"]] == [m["level"] for m in pp1]
    assert [m["tokens"] for m in pp2] == [m["tokens"] for m in pp1]
    assert [m["loss"] for m in pp2] == pytest.approx([m["loss"] for m in pp1], rel=1e-5)
    ref, got = _grads(out / "pp1"), _grads(out / "pp2")
    assert len(ref) == len(got) == total
    assert_same_grads(got, ref)


def test_levels_switch_the_recompute_of_each_stage(level_runs):
    """Each micro-batch's forward checkpointed exactly the first k ViT / LLM layers of its
    stage that its level gives (global layer numbers: stage 1 holds ViT layer 3, LLM 0-3), and
    each such layer was run again in the backward once per micro-batch: recompute switches
    with the level, per stage."""
    _, runs, _, _ = level_runs
    first = {0: (0, 0), 1: (3, 0)}  # first ViT / LLM layer of each stage
    for rank in (0, 1):
        rec = runs["pp2"][rank]
        want_total = {}
        for m in rec["micro"]:
            vit, llm = (RECOMPUTE[m["level"]][t][rank] for t in (0, 1))
            want = [f"vit.{first[rank][0] + i}" for i in range(vit)]
            want += [f"llm.{first[rank][1] + i}" for i in range(llm)]
            assert m["checkpointed"] == sorted(want), (rank, m["level"])
            for name in want:
                want_total[name] = want_total.get(name, 0) + 1
        assert rec["recomputed"] == want_total
    assert all(not m["checkpointed"] for m in runs["pp1"][0]["micro"])
    assert runs["pp1"][0]["recomputed"] == {}


def test_levels_resume_across_a_level_change_continues_exactly(level_runs):
    """Stopped after 5 steps (short level) and resumed: the resumed steps start with a top
    level step and read the same samples with the same losses as the uninterrupted run."""
    _, runs, total, stop = level_runs
    whole, stopped, resumed = runs["pp2"], runs["stopped"], runs["resumed"]
    steps = _steps_of(whole[1]["micro"])
    assert steps[stop - 1][0]["level"] != steps[stop][0]["level"]  # a level change at the stop
    k = sum(len(s) for s in steps[:stop])
    for rank in (0, 1):
        assert resumed[rank]["start"] == stop
        w, s, r = whole[rank]["micro"], stopped[rank]["micro"], resumed[rank]["micro"]
        assert len(s) == k and len(s) + len(r) == len(w)
        assert [m["indices"] for m in s + r] == [m["indices"] for m in w]
        assert [m["level"] for m in s + r] == [m["level"] for m in w]
    w, r = whole[1]["micro"], resumed[1]["micro"]
    assert [m["loss"] for m in r] == pytest.approx([m["loss"] for m in w[k:]], rel=1e-6)


def test_levels_consumed_samples_survive_the_checkpoint(level_runs):
    """Megatron's "consumed samples" with packing levels (4 and 2 micro-batches a step) in the
    stopped run, in the checkpoint it saved and in the resumed run: the samples trained so far.
    Oracle: the micro-batches the uninterrupted run drew, counted here."""
    out, runs, total, stop = level_runs
    steps = _steps_of(runs["pp2"][0]["micro"])
    trained = np.cumsum([sum(len(m["indices"]) for m in s) for s in steps]).tolist()
    assert len(trained) == total and len(set(np.diff(trained))) > 1  # steps differ in samples

    def logged(name):
        text = (out / name / "stdout.txt").read_text()
        found = re.findall(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)", text)
        return {int(i): int(c) for i, c in found}

    from megatron_omnibal.megatron.checkpoint.checkpoint_check import read_saved_run
    from megatron_omnibal.megatron.runtime.compat import ensure_typing_override

    assert logged("stopped") == {it: trained[it - 1] for it in range(1, stop + 1)}
    ensure_typing_override()  # megatron.training on Python 3.11
    saved = read_saved_run(str(out / "ckpt"))
    assert (saved.iteration, saved.consumed_samples) == (stop, trained[stop - 1])
    assert logged("resumed") == {it: trained[it - 1] for it in range(stop + 1, total + 1)}


def test_levels_log_counts_samples_rates_and_epochs(lengths_file, tmp_path):
    """DP=2 with packing levels (4 and 2 micro-batches per step and rank) over an epoch
    boundary. Oracle: the micro-batches both ranks drew. Megatron's "consumed samples" is the
    samples trained so far (not 2 x 2 packs a step), the OmniBal line's samples per step are the
    step's, its samples/s is them over the step's time (of the order of them over Megatron's
    elapsed time), and its epoch and step are where the drawn samples place it (an epoch ends
    when every sample was trained once)."""
    total = 10
    flags = _flags(lengths_file, "--global-batch-size", "4", "--train-iters", str(total),
                   "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4",
                   "--omnibal-levels", LEVELS)  # fmt: skip
    proc = _torchrun(2, tmp_path / "run", flags)
    _ok(proc)
    records = _records(tmp_path / "run")
    per_rank = [_steps_of(records[rank]["micro"]) for rank in (0, 1)]
    assert [len(s) for s in per_rank] == [total, total]
    samples, epochs, seen, epoch = [], [], set(), 0
    for a, b in zip(*per_rank, strict=True):
        assert a[0]["level"] == b[0]["level"]  # a step is of one level on every rank
        indices = [i for m in a + b for i in m["indices"]]
        assert not seen & set(indices)
        seen |= set(indices)
        samples.append(len(indices))
        epochs.append(epoch)
        if len(seen) == 40:
            seen, epoch = set(), epoch + 1
    assert epochs[-1] >= 1 and {s[0]["level"] for s in per_rank[0]} == {0, 1}
    first_epoch_steps = epochs.count(0)
    consumed = dict(zip(range(1, total + 1), np.cumsum(samples).tolist(), strict=True))
    logged = re.findall(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)", proc.stdout)
    assert {int(i): int(c) for i, c in logged} == consumed
    megatron_ms = dict(re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration "
                                  r"\(ms\):\s+([\d.]+)", proc.stdout))  # fmt: skip
    ours = re.findall(r"omnibal: iteration\s+(\d+) \| samples/step ([\d.]+) .*\| tokens/step "
                      r"([\d.]+) .*\| tokens/s ([\d.]+) \| samples/s ([\d.]+) .*?\| epoch (\d+) "
                      r"step (\d+)/(\d+) \|", proc.stdout)  # fmt: skip
    assert [int(row[0]) for row in ours] == list(range(1, total + 1))
    for it, per_step, tokens, token_rate, rate, epoch, step, steps in ours:
        k = int(it) - 1
        assert int(epoch) == epochs[k] and int(step) == k + 1 - first_epoch_steps * epochs[k]
        if epochs[k] == 0:
            assert int(steps) == first_epoch_steps
        assert float(per_step) == samples[k]
        # the step's samples over the step's time (the tokens' rate over the same time), and of
        # the order of Megatron's samples over its elapsed time: both time the same step, read at
        # other points, so only a rate over another span (the run so far, or every step's
        # samples) falls below half of it; a CI run under load measured ours 13% slower
        ratio = samples[k] / float(tokens)
        assert abs(float(rate) - float(token_rate) * ratio) <= 0.05 * (1 + ratio) + 1e-9
        assert float(rate) >= 0.5 * samples[k] / (float(megatron_ms[it]) / 1e3)
