"""Read back what train_record.py wrote for one torchrun: per-rank records, the head stage's
micro-batches, the gradients of each optimizer step and the parameters at a step, merged over
the pipeline stages by model-wide name (the same at every layout). A test imports it (and
WORKER, the script) after putting this folder on sys.path."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

WORKER = Path(__file__).resolve().with_name("train_record.py")


def records(out: Path) -> dict[int, dict]:
    """{global rank: record} of every rank."""
    return {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
            for p in sorted(Path(out).glob("rank*.json"))}  # fmt: skip


def head_micro(recs: dict[int, dict]) -> list[dict]:
    """The last pipeline stage's micro-batch records (it computes the losses): with virtual
    stages, those of its last model chunk."""
    last = max(r["pp_rank"] for r in recs.values())
    rank = min(k for k, r in recs.items() if r["pp_rank"] == last)
    micro = recs[rank]["micro"]
    chunk = max(m.get("chunk", 0) for m in micro)
    return [m for m in micro if m.get("chunk", 0) == chunk]


def step_grads(out: Path) -> list[dict[str, torch.Tensor]]:
    """Per optimizer step, {global name: gradient} over all stages (OMNIBAL_TEST_GRADS)."""
    steps: list[dict[str, torch.Tensor]] | None = None
    for path in sorted(Path(out).glob("grads_rank*.pt")):
        mine = torch.load(path)
        if steps is None:
            steps = [{} for _ in mine]
        for step, grads in zip(steps, mine, strict=True):
            assert not set(step) & set(grads), "a parameter on two stages"
            step.update(grads)
    return steps or []


def assert_same_grads(
    got: list[dict[str, torch.Tensor]], ref: list[dict[str, torch.Tensor]], rel: float = 1e-5
) -> None:
    """Every step applied the reference's gradients (each nonzero there) within `rel`."""
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert set(a) == set(b)
        for name, g in b.items():
            assert g.abs().max() > 0, f"step {step}: {name} has no gradient"
            err = float((a[name] - g).abs().max() / g.abs().max())
            assert err <= rel, f"step {step}: gradient of {name} differs by {err:.2e}"


def params(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """{global name: tensor} over all ranks (RECORD_PARAMS_AT_STEP), and {name: pipeline
    rank}."""
    recs = records(out)
    merged, stage = {}, {}
    for file in sorted(Path(out).glob("params*.pt")):
        rank = int(file.stem.removeprefix("params"))
        for name, value in torch.load(file, weights_only=True).items():
            assert name not in merged or torch.equal(merged[name], value), name
            merged[name] = value
            stage[name] = recs[rank]["pp_rank"]
    return merged, stage


def built_params(out: Path) -> dict[str, torch.Tensor]:
    """{global name: tensor} of every rank's parameters as built, before any weights were set
    (RECORD_BUILT_PARAMS); a name on two ranks must hold equal tensors."""
    merged: dict[str, torch.Tensor] = {}
    for file in sorted(Path(out).glob("built*.pt")):
        for name, value in torch.load(file, weights_only=True).items():
            assert name not in merged or torch.equal(merged[name], value), name
            merged[name] = value
    return merged


def recorded_run(
    worker: Path, nproc: int, out: Path, flags: list[str], env: dict[str, str] | None = None,
    timeout: float = 300,
) -> SimpleNamespace:
    """train_record.py under torchrun (the test fails on a non-zero exit): its out folder,
    stdout, stderr and records."""
    from launch import run_ranks

    code, stdout, stderr = run_ranks(worker, nproc, [str(out), *flags], timeout, env)
    assert code == 0, stdout[-3000:] + stderr[-6000:]
    return SimpleNamespace(out=out, stdout=stdout, stderr=stderr, records=records(out))
