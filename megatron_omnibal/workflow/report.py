"""What a fine-tuning run gave: the plan's predicted step time beside the measured ones (the
preflight's and training's), the loss curve and the balance of the data (PNGs), where the
exported checkpoint is and compare-hf's verdict; written as OUTPUT/report.md and
OUTPUT/report.json and printed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from megatron_omnibal.workflow.config import FinetuneConfig
from megatron_omnibal.workflow.freshness import staleness
from megatron_omnibal.workflow.paths import OutputPaths, checkpoint_iteration
from megatron_omnibal.workflow.steps import OMNIBAL, build_step
from megatron_omnibal.workflow.train_log import measured_step_ms, parse_train_log


def build_report(config: FinetuneConfig, paths: OutputPaths) -> dict[str, Any]:
    """The report's figures, from the files the steps wrote (None where a step has not run)."""
    report: dict[str, Any] = {"output": str(paths.root), "device": config.device}
    if paths.plan.is_file():
        from megatron_omnibal.planner.plan_file.plan import load_plan

        plan = load_plan(paths.plan)
        par = plan.parallel
        report["plan"] = {
            "file": str(paths.plan),
            "hardware": plan.hardware_spec.name,
            "tp": par.tp,
            "pp": par.pp,
            "dp": par.dp,
            "micro_batches": par.micro_batches,
            "predicted_step_ms": plan.predicted.step_ms,
        }
        report["balance_png"] = _balance_png(config, paths, plan)
    report["preflight"] = (_preflight(paths.preflight)
                           if _up_to_date("preflight", config, paths) else None)  # fmt: skip
    rows = _train_rows(paths)
    losses = [r for r in rows if "loss" in r]
    report["train"] = {
        "checkpoint": str(paths.train_checkpoint),
        "iteration": checkpoint_iteration(paths.train_checkpoint),
        "measured_step_ms": measured_step_ms(rows),
        "first_loss": losses[0]["loss"] if losses else None,
        "last_loss": losses[-1]["loss"] if losses else None,
        "loss_png": str(_plot_loss(losses, paths.loss_png)) if losses else None,
    }
    report["step_time"] = step_time(report)
    # an export or a verdict of an earlier training is not this run's: left out until redone
    report["export"] = str(paths.export) if _up_to_date("export", config, paths) else None
    report["compare_hf"] = _verdict(paths.compare) if _up_to_date("compare-hf", config,
                                                                  paths) else None  # fmt: skip
    return report


def step_time(report: dict[str, Any]) -> dict[str, Any] | None:
    """The measured step time beside a prediction for the same device: the preflight's
    calibrated plan (fitted to the device that ran), else the plan's own model when training
    ran on GPUs (`device: cuda`, taken to be the plan's). A `device: cpu` trial without a
    calibration has no prediction for its device: nothing is compared (None: no plan)."""
    plan, measured = report.get("plan"), report["train"]["measured_step_ms"]
    if not plan:
        return None
    calibrated = (report.get("preflight") or {}).get("calibrated_step_ms")
    if calibrated:
        predicted, basis = calibrated, "the preflight's calibrated plan, for this device"
    elif report["device"] != "cpu":
        predicted, basis = plan["predicted_step_ms"], f"the plan, modeled for {plan['hardware']}"
    else:
        return {"predicted_ms": None, "basis": None, "measured_ms": measured, "ratio": None}
    ratio = measured / predicted if measured and predicted else None
    return {"predicted_ms": predicted, "basis": basis, "measured_ms": measured, "ratio": ratio}


def _up_to_date(step: str, config: FinetuneConfig, paths: OutputPaths) -> bool:
    return staleness(build_step(step, config, paths), paths) is None


def _train_rows(paths: OutputPaths) -> list[dict]:
    """Logged iterations of every training log (several nodes: each node's own log; the loss
    is printed by the last rank)."""
    logs = sorted(paths.log("train").parent.glob("train*.log"))
    return parse_train_log("\n".join(p.read_text(errors="replace") for p in logs))["rows"]


def _plot_loss(rows: list[dict], path: Path) -> Path:
    from megatron_omnibal.data.stats.plots import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("training loss (logged iterations)")
    ax.grid(alpha=0.3)
    return _save(fig, plt, path)


def _balance_png(config: FinetuneConfig, paths: OutputPaths, plan: Any) -> str | None:
    """`omnibal balance` of the length file under the plan's budgets and sizes (beside random
    batching), redrawn when the plan or the lengths changed."""
    png = paths.balance_png
    sources = [paths.plan, paths.lengths]
    if png.is_file() and all(png.stat().st_mtime_ns >= p.stat().st_mtime_ns for p in sources):
        return str(png)
    cmd = [*OMNIBAL, "balance", str(paths.lengths), "--plan", str(paths.plan), "--dp",
           str(plan.parallel.dp), "--micro-batches", str(plan.parallel.micro_batches),
           "--vit-budget", str(plan.data.vit_budget), "--token-budget",
           str(plan.data.token_budget), "--seed", str(config.seed), "--png", str(png)]  # fmt: skip
    with open(paths.log("report"), "a") as log:
        ok = subprocess.run(cmd, stdout=log, stderr=log).returncode == 0
    return str(png) if ok else None


def _preflight(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    calibrated = (doc.get("calibration") or {}).get("predicted_step_ms", {}).get("after")
    return {"ok": doc["ok"], "step_ms": doc["step_ms"], "calibrated_step_ms": calibrated,
            "file": str(path)}


def _verdict(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    worst = max(doc[k]["max_rel"] for k in ("logits", "vit", "llm"))
    return {"ok": doc["ok"], "max_rel": worst, "tolerance": doc["tolerance"], "file": str(path)}


def render(report: dict[str, Any]) -> str:
    """The report as markdown."""
    lines = [f"# omnibal finetune: {report['output']}", ""]
    plan, train = report.get("plan"), report["train"]
    if plan:
        lines.append(
            f"- plan: tp={plan['tp']} pp={plan['pp']} dp={plan['dp']}, "
            f"{plan['micro_batches']} micro-batches per step ({plan['file']})"
        )
        lines.append(_step_time_line(report))
    check = report.get("preflight")
    if check:
        lines.append(
            f"- preflight: {'passed' if check['ok'] else 'FAILED'}, step time measured "
            f"{_ms(check['step_ms']['measured'])} on {report['device']} ({check['file']})"
        )
    if train["iteration"] is not None:
        loss = (
            f"lm loss {train['first_loss']:.3f} -> {train['last_loss']:.3f}"
            if train["first_loss"] is not None
            else "no logged loss"
        )
        lines.append(f"- training: iteration {train['iteration']}, {loss} ({train['checkpoint']})")
    pictures = [
        f"{name} {path}"
        for name, path in (
            ("loss curve", train["loss_png"]),
            ("balance", report.get("balance_png")),
        )
        if path
    ]
    if pictures:
        lines.append(f"- pictures: {', '.join(pictures)}")
    export = report["export"] or "none of this training yet"
    lines.append(f"- exported Hugging Face checkpoint: {export}")
    verdict = report["compare_hf"]
    if verdict:
        word = "passed" if verdict["ok"] else "FAILED"
        lines.append(
            f"- compare-hf: {word}, largest relative difference {verdict['max_rel']:.2e} "
            f"(tolerance {verdict['tolerance']:.0e}; {verdict['file']})"
        )
    else:
        lines.append("- compare-hf: not run on this training yet")
    return "\n".join(lines) + "\n"


def _step_time_line(report: dict[str, Any]) -> str:
    plan, compared = report["plan"], report.get("step_time") or step_time(report)
    measured = (f"measured {_ms(compared['measured_ms'])} on {report['device']} (median of the "
                "logged iterations)")
    if compared["predicted_ms"] is None:
        return (f"- step time: {measured}; the plan predicts {plan['predicted_step_ms']:.1f} ms "
                f"for {plan['hardware']}, a different device: not compared (a preflight with "
                "--calibrate predicts for the device that ran)")
    ratio = f", measured/predicted {compared['ratio']:.2f}" if compared["ratio"] else ""
    return (f"- step time: predicted {compared['predicted_ms']:.1f} ms ({compared['basis']}), "
            f"{measured}{ratio}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def write_report(config: FinetuneConfig, paths: OutputPaths) -> dict[str, Any]:
    report = build_report(config, paths)
    paths.report_json.write_text(json.dumps(report, indent=1) + "\n")
    paths.report_md.write_text(render(report))
    return report
