"""The `omnibal` command line fails early and clearly: output paths and numbers are checked by the
parser before any work (exit 2 naming the flag), nothing is renamed, exit statuses follow the
conventions (2 usage, 130 Ctrl-C, 141 closed pipe) without tracebacks, and degenerate length
files give a valid plan or one line saying what is wrong."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_omnibal.balance.plan_io import load_plan
from megatron_omnibal.cli import main
from megatron_omnibal.data.lengths import from_arrays, save_lengths

CLI = [sys.executable, "-m", "megatron_omnibal.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BUDGETS = ["--vit-budget", "18", "--token-budget", "6016"]


def _lengths(path, n, seed=0):
    rng = np.random.default_rng(seed)
    vit = rng.integers(1, 6, n)
    save_lengths(from_arrays(vit, 256 * vit + rng.integers(20, 120, n)), path)
    return str(path)


@pytest.fixture()
def lengths(tmp_path):
    return _lengths(tmp_path / "lengths.jsonl", 200)


def _usage_error(argv, capsys) -> str:
    """Run `omnibal argv` expecting argparse's exit 2; its stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_no_command_prints_usage_and_exits_2():
    proc = subprocess.run(CLI, capture_output=True, text=True, env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: omnibal") and "balance" in proc.stderr
    assert proc.stdout == ""


def test_ctrl_c_exits_130_with_one_line_and_no_traceback(tmp_path):
    """Ctrl-C in a terminal signals the whole process group: the parent and its worker
    processes. A stats run with 2 workers over 200,000 records is interrupted once its progress
    bar shows it counting."""
    from megatron_omnibal.data.formats.generate import TEMPLATE_SPECIALS, train_tokenizer

    tok = train_tokenizer(["what is the cat", "a dog is here"], vocab_size=300,
                          special_tokens=TEMPLATE_SPECIALS[1:], byte_level=True)
    tok.save(str(tmp_path / "tok.json"))
    record = json.dumps({"conversations": [{"from": "human", "value": "what is the cat"},
                                           {"from": "gpt", "value": "a dog"}]})
    (tmp_path / "data.jsonl").write_text((record + "\n") * 200_000)
    proc = subprocess.Popen(
        [*CLI, "stats", str(tmp_path / "data.jsonl"), "--model", "internvl2-8b", "--tokenizer",
         str(tmp_path / "tok.json"), "--out", str(tmp_path / "out.npz"), "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, start_new_session=True,
        # as in a terminal (a pytest-xdist worker ignores SIGINT; its children would inherit it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = b""  # up to the progress bar's first count above 0: the workers are counting
    while not re.search(rb"\| *[1-9][0-9]*/200000", first):
        byte = proc.stderr.read(1)
        assert byte, first.decode()
        first += byte
    os.killpg(proc.pid, signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    err = (first + rest).decode()
    assert proc.returncode == 130, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1] == "omnibal stats: interrupted"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Process" not in err
    assert not (tmp_path / "out.npz").exists()


def test_a_closed_pipe_ends_quietly(lengths):
    """`omnibal balance ... | head`, with a reader that is gone before the table is written."""
    proc = subprocess.Popen([*CLI, "balance", lengths, "--dp", "8", *BUDGETS],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["balance", "{lengths}", "--dp", "2", *BUDGETS, "--out", "{tmp}"],
         "argument --out: {tmp} is a directory"),
        (["balance", "{lengths}", "--dp", "2", *BUDGETS, "--out", "{tmp}/plan"],
         "argument --out: {tmp}/plan: expected a file name ending in .npz"),
        (["balance", "{lengths}", "--dp", "2", *BUDGETS, "--out", "{tmp}/x.txt"],
         "argument --out: {tmp}/x.txt: expected a file name ending in .npz"),
        (["balance", "{lengths}", "--dp", "2", *BUDGETS, "--json", "/proc/figures.json"],
         "argument --json: /proc/figures.json: cannot write"),
        (["balance", "{lengths}", "--dp", "2", *BUDGETS, "--png", "{tmp}/balance"],
         "argument --png: {tmp}/balance: expected a file name ending in .png"),
        (["balance", "{tmp}/missing.npz", "--dp", "2", *BUDGETS, "--out", "{lengths}/p.npz"],
         "argument --out: {lengths}/p.npz: directory {lengths} is not a directory"),
        (["stats", "{tmp}/missing.json", "--model", "tiny", "--out", "{tmp}/lengths.txt"],
         "argument --out: {tmp}/lengths.txt: expected a file name ending in .npz or .json"),
        (["stats", "{tmp}/missing.json", "--model", "tiny", "--out", "/proc/new/lengths.npz"],
         "argument --out: /proc/new/lengths.npz: cannot write in /proc"),
        (["stats", "{tmp}/missing.json", "--model", "tiny", "--out", "{tmp}/l.npz", "--skipped",
          "{tmp}"], "argument --skipped: {tmp} is a directory"),
        (["stats", "{tmp}/missing.json", "--model", "tiny", "--out", "{tmp}/l.npz", "--png",
          "{tmp}/stats.jpg"], "argument --png: {tmp}/stats.jpg: expected a file name ending in"),
        (["simulate", "--plan", "{tmp}/p.json", "--png", "{tmp}/gantt"],
         "argument --png: {tmp}/gantt: expected a file name ending in .png"),
        (["convert", "hf-to-megatron", "{tmp}/missing", "--out", "{lengths}", "--tp", "1"],
         "argument --out: {lengths} exists and is not a directory"),
        (["convert", "megatron-to-hf", "{tmp}/missing", "--like", "{tmp}", "--out",
          "/proc/hf"], "argument --out: /proc/hf: cannot write in /proc"),
    ],
)  # fmt: skip
def test_output_paths_are_checked_before_any_work(argv, message, lengths, tmp_path, capsys):
    """The inputs named here do not even exist: the output is refused first, by the parser."""
    fill = {"lengths": lengths, "tmp": str(tmp_path)}
    err = _usage_error([a.format(**fill) for a in argv], capsys)
    assert message.format(**fill) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lengths.jsonl"]  # nothing created


def test_files_are_written_where_the_flags_say_and_named(lengths, tmp_path, capsys):
    out, figures = tmp_path / "new" / "plan.npz", tmp_path / "figures.data"
    _usage_error(["balance", lengths, "--dp", "2", *BUDGETS, "--out", str(out)], capsys)
    (tmp_path / "new").mkdir()
    assert main(["balance", lengths, "--dp", "2", *BUDGETS, "--out", str(out), "--json",
                 str(figures)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert f"wrote {out}\n" in text and f"wrote {figures}\n" in text
    assert sorted(p.name for p in tmp_path.rglob("*")) == [
        "figures.data", "lengths.jsonl", "new", "plan.npz"]  # fmt: skip
    load_plan(out).check(200)
    assert json.loads(figures.read_text())["meta"]["dp"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dp", "0"], "argument --dp: must be a positive integer, got 0"),
        (["--dp", "2", "--micro-batches", "0"], "argument --micro-batches: must be a positive"),
        (["--dp", "2", "--vit-budget", "18", "--token-budget", "0"],
         "argument --token-budget: must be a positive integer, got 0"),
        (["--dp", "2", *BUDGETS, "--baseline-samples", "0"],
         "argument --baseline-samples: must be a positive integer, got 0"),
        (["--dp", "2", "--auto-budget", "--samples-per-pack", "0"],
         "argument --samples-per-pack: must be > 0"),
        (["--dp", "2", *BUDGETS, "--tail-tolerance", "2"],
         "argument --tail-tolerance: must lie in [0, 1]"),
        (["--dp", "2", *BUDGETS, "--seed", "-1"], "argument --seed: must be >= 0"),
        (["--dp", "2", *BUDGETS, "--seed", "4294967296"], "argument --seed: must be at most"),
        (["--dp", "2", *BUDGETS, "--algorithm", "isf", "--isf-threshold",
          "99999999999999999999"], "argument --isf-threshold: must be at most 2147483647"),
        (["--dp", "2", *BUDGETS, "--cost", "nan,1,0"],
         "argument --cost: expected three finite numbers A,B,C >= 0, not all 0, got 'nan,1,0'"),
        (["--dp", "2", *BUDGETS, "--cost", "1,2"], "argument --cost: expected three finite"),
    ],
)  # fmt: skip
def test_balance_numbers_are_range_checked_by_the_parser(argv, message, lengths, capsys):
    assert message in _usage_error(["balance", lengths, *argv], capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["stats", "d.json", "--model", "tiny", "--out", "o.npz", "--max-tiles", "0"],
         "argument --max-tiles: must be a positive integer, got 0"),
        (["stats", "d.json", "--model", "tiny", "--out", "o.npz", "--min-tiles", "0"],
         "argument --min-tiles: must be a positive integer, got 0"),
        (["stats", "d.json", "--model", "tiny", "--out", "o.npz", "--max-tokens", "0"],
         "argument --max-tokens: must be a positive integer, got 0"),
        (["stats", "d.json", "--model", "tiny", "--out", "o.npz", "--workers", "0"],
         "argument --workers: must be a positive integer, got 0"),
        (["stats", "d.json", "--model", "tiny", "--out", "o.npz", "--chunk-size", "-5"],
         "argument --chunk-size: must be a positive integer"),
        (["convert", "hf-to-megatron", "hf", "--out", "o", "--tp", "0"],
         "argument --tp: must be a positive integer, got 0"),
        (["convert", "hf-to-megatron", "hf", "--out", "o", "--omnibal-vit-pp-layers", "2,-1"],
         "argument --omnibal-vit-pp-layers: counts must lie in [0, 2147483647]"),
        (["convert", "megatron-to-hf", "ck", "--like", "hf", "--out", "o", "--max-shard-size",
          "infGB"], "argument --max-shard-size: expected a size like 5GB"),
        (["convert", "megatron-to-hf", "ck", "--like", "hf", "--out", "o", "--iteration", "-1"],
         "argument --iteration: must be >= 0"),
        (["compare-hf", "hf", "ck", "--tolerance", "1"], "argument --tolerance: must be in (0, 1)"),
        (["compare-hf", "hf", "ck", "--omnibal-llm-pp-layers", "3,-1"],
         "argument --omnibal-llm-pp-layers: counts must lie in"),
        (["compare-hf", "hf", "ck", "--seed", "-3"], "argument --seed: must be >= 0"),
    ],
)  # fmt: skip
def test_other_commands_range_check_their_numbers(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert message in _usage_error(argv, capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--omnibal-vit-budget", "0"], "argument --omnibal-vit-budget: must be a positive"),
        (["--omnibal-token-budget", "-4"], "argument --omnibal-token-budget: must be a positive"),
        (["--omnibal-cost", "nan,1,0"], "argument --omnibal-cost: expected three finite numbers"),
        (["--omnibal-curriculum-steps", "-1"], "argument --omnibal-curriculum-steps: must be >="),
        (["--omnibal-text-scale", "0"], "argument --omnibal-text-scale: must be a positive"),
        (["--omnibal-vit-lr-mult", "0"], "argument --omnibal-vit-lr-mult: must be > 0"),
        (["--omnibal-vit-lr-mult", "inf"], "argument --omnibal-vit-lr-mult: expected a finite"),
    ],
)
def test_pretrain_vlm_numbers_are_range_checked_by_the_parser(argv, message, capsys):
    from megatron_omnibal.megatron.flags.args import add_omnibal_args

    parser = add_omnibal_args(argparse.ArgumentParser(prog="pretrain_vlm"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--omnibal", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert parser.parse_args(["--omnibal-cost", "0,1,0.5"]).omnibal_cost == "0,1,0.5"  # text


def test_a_huge_dp_is_refused_at_once(lengths):
    start = time.perf_counter()
    proc = subprocess.run([*CLI, "balance", lengths, "--dp", "100000000", *BUDGETS],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert time.perf_counter() - start < 60
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"omnibal balance: error: {lengths} has 200 sample(s), fewer than the 100000000 packs "
        "of one step (--dp 100000000 x --micro-batches 1); lower --dp or --micro-batches"]


def test_fewer_samples_than_ranks_is_one_clear_error(tmp_path, capsys):
    path = _lengths(tmp_path / "three.npz", 3)
    assert main(["balance", path, "--dp", "2", "--micro-batches", "2", *BUDGETS]) == 2
    assert capsys.readouterr().err == (
        f"omnibal balance: error: {path} has 3 sample(s), fewer than the 4 packs of one step "
        "(--dp 2 x --micro-batches 2); lower --dp or --micro-batches\n")


@pytest.mark.parametrize(("samples", "dp"), [(1, 1), (15, 8), (9, 8)])
def test_one_step_of_data_gives_a_valid_plan_and_a_baseline(samples, dp, tmp_path, capsys):
    """Random batching keeps whole steps only; with barely one step's worth of samples it must
    still have one (15 samples on 8 ranks: 2 per micro-batch rounded from 1.875 needs 16)."""
    path = _lengths(tmp_path / "few.jsonl", samples, seed=samples)
    out, figures = tmp_path / "plan.npz", tmp_path / "figures.json"
    assert main(["balance", path, "--dp", str(dp), *BUDGETS, "--out", str(out), "--json",
                 str(figures)]) == 0, capsys.readouterr().err  # fmt: skip
    plan = load_plan(out)
    plan.check(samples)
    assert sorted(plan.samples.tolist()) == list(range(samples))  # every sample once
    doc = json.loads(figures.read_text())
    assert doc["random_batching"]["steps"] == 1
    assert doc["random_batching"]["trained_samples"] == dp * (samples // dp)


@pytest.mark.parametrize(
    ("content", "message"),
    [("[]", "{path}: no samples"),
     ("", "{path}: expected a JSON list of records")],
)
def test_an_empty_length_file_is_one_clear_error(content, message, tmp_path, capsys):
    path = tmp_path / "empty.json"
    path.write_text(content)
    assert main(["balance", str(path), "--dp", "2", *BUDGETS]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"omnibal balance: error: {message.format(path=path)}")
    assert err.count("\n") == 1


def test_every_sample_skipped_is_an_error_not_an_empty_plan(lengths, capsys):
    assert main(["balance", lengths, "--dp", "2", "--vit-budget", "0", "--token-budget", "6016",
                 "--oversize", "skip"]) == 2  # fmt: skip
    assert "all 200 samples exceed the budgets and --oversize skip leaves every one out" in (
        capsys.readouterr().err)


def test_help_texts_name_only_commands_that_exist(capsys):
    """A help text that sends the user to `omnibal X` must name a real command."""
    from megatron_omnibal.cli import _command_names

    names = _command_names()
    for name in names:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        for mentioned in re.findall(r"\bomnibal ([a-z][a-z-]*)", text):
            assert mentioned in names, f"omnibal {name} --help names `omnibal {mentioned}`"
    with pytest.raises(SystemExit):
        main(["stats", "--help"])
    assert "llava-1.5-7b" in capsys.readouterr().out  # the presets it accepts, listed
