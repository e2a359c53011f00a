"""`omnibal plan`: data budgets, parallel sizes, partition and recompute -> plan.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_omnibal.cli_args import non_negative_int, output_file, positive_int

HELP = "plan budgets, TP/PP, the stage partition and per-stage recompute (writes plan.json)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name or a JSON/YAML model file")
    parser.add_argument("--hardware", required=True, help="preset name or a JSON/YAML GPU file")
    parser.add_argument("--gpus", type=positive_int, required=True, help="total GPUs")
    parser.add_argument(
        "--lengths",
        required=True,
        help="length statistics of the training data (any format `omnibal stats` writes or "
        "load_lengths reads), or 'example' for the shipped InternVL subset",
    )
    parser.add_argument(
        "--tp", type=positive_int, help="tensor parallel size (searched if omitted)"
    )
    parser.add_argument(
        "--pp", type=positive_int, help="pipeline parallel size (searched if omitted)"
    )
    parser.add_argument(
        "--vpp",
        type=_vpp,
        default=1,
        help="model chunks per pipeline rank: 1 (default) for 1F1B, more for interleaved 1F1B, "
        "'auto' to search 1-4 (pretrain_vlm trains both; the preflight measures 1F1B only)",
    )
    parser.add_argument(
        "--ep", type=positive_int,
        help="expert parallel size of a mixture-of-experts LLM (Megatron's "
        "--expert-model-parallel-size; must divide the experts and the data-parallel size; "
        "searched if omitted; a dense LLM has none)",
    )  # fmt: skip
    parser.add_argument(
        "--vit-on-first-stage", action="store_true",
        help="keep the whole vision tower and projector (DeepStack mergers included) on the "
        "first pipeline stage, as Megatron-Bridge, ms-swift and MindSpeed-MM run a VLM: what "
        "the plan gains over that layout is what splitting the tower over stages brings",
    )  # fmt: skip
    parser.add_argument(
        "--micro-batches",
        type=positive_int,
        help="micro-batches per step and replica (default: best of 2 or 4 x PP)",
    )
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        default=1024,
        help="samples per optimizer step (default 1024)",
    )
    parser.add_argument(
        "--mode",
        choices=("exact", "bmp", "megatron"),
        default="exact",
        help="partition search (default exact)",
    )
    parser.add_argument(
        "--profile",
        help="measured layer profile from `omnibal profile` (TP 1) instead of the FLOPs model",
    )
    parser.add_argument(
        "--levels",
        metavar="auto|V/T[xM],..",
        help="packing levels (hierarchical balance packing), each with its own per-stage "
        "recompute: 'auto' (the set of least modeled epoch time), or levels below the plan's "
        "budgets, which form the last level (xM: micro-batches per rank; default: the same "
        "tokens per step); default: one level",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the drawn batch")
    parser.add_argument(
        "--out", type=output_file, default="plan.json", help="where to write the plan"
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--lora-rank", type=positive_int, default=None, metavar="R",
        help="plan a LoRA run (pretrain_vlm's --omnibal-lora-rank): base weights frozen "
        "(no gradient, no optimizer state), adapters of rank R trained; the baseline too",
    )  # fmt: skip
    parser.add_argument(
        "--lora-targets", default=None, metavar="GLOBS",
        help="the layers LoRA adapts, as --omnibal-lora-targets (default: the LLM's linear_qkv, "
        "linear_proj, linear_fc1, linear_fc2)",
    )  # fmt: skip
    parser.add_argument(
        "--lora-train", default=None, metavar="PARTS",
        help="parts trained in full beside the adapters, as --omnibal-lora-train",
    )  # fmt: skip


def headline(plan) -> str:
    """The first line: the speedup against the best Megatron-LM configuration that fits."""
    p = plan.predicted
    base = p.baseline
    if base is None:
        return (
            f"modeled step {p.step_ms / 1000:.2f} s; no speedup to report: no Megatron-LM "
            f"configuration of this model fits {plan.memory_budget_gib:.1f} GiB per GPU "
            "(every TP/PP/micro-batch size/recompute choice was tried)"
        )
    layers = "/".join(str(n) for n in base.llm_layers_per_stage)
    recompute = (
        ", ".join(
            x
            for x in (
                "ViT recomputed" if base.recompute_vision else "",
                f"{base.recompute_num_layers} LLM layers/stage recomputed"
                if base.recompute_num_layers
                else "",
            )
            if x
        )
        or "no recompute"
    )
    return (
        f"modeled speedup {p.speedup:.2f}x over the best Megatron-LM configuration that fits "
        f"memory ({p.step_ms / 1000:.2f} s vs {base.step_ms / 1000:.2f} s per step; baseline "
        f"tp={base.tp} pp={base.pp} dp={base.dp}" + (f" ep={base.ep}" if base.ep > 1 else "")
        + (f", {base.vpp} chunks per rank" if base.vpp > 1 else "")
        + f", micro-batch size {base.micro_batch_size}, LLM "
        f"layers {layers} with the ViT on stage 0, {recompute})"
    )


def print_table(plan, out=None) -> None:
    """The headline, the per-stage table and the details, for people."""
    out = out or sys.stdout
    par, data, p = plan.parallel, plan.data, plan.predicted
    print(headline(plan), file=out)
    print(
        f"{plan.model_spec.name} on {par.gpus} x {plan.hardware_spec.name}: tp={par.tp} "
        f"pp={par.pp} dp={par.dp}" + (f" ep={par.ep}" if par.ep > 1 else "")
        + f" micro-batches={par.micro_batches}"
        + (f" vpp={par.vpp} (interleaved 1F1B)" if par.vpp > 1 else ""),
        file=out,
    )
    print(f"budgets per micro-batch: {data.vit_budget} tiles, {data.token_budget} tokens", file=out)
    print(
        f"{'stage' if par.vpp == 1 else 'r.chk':>5} {'vit layers':>11} {'proj':>4} "
        f"{'llm layers':>11} {'fwd ms':>9} "
        f"{'bwd ms':>9} {'recompute v/l':>13} {'mem GiB':>8}",
        file=out,
    )
    for st in plan.stages:
        v, lm = st.vit_layers, st.llm_layers
        vit = f"{v[0]}-{v[1] - 1}" if v[1] > v[0] else "-"
        llm = f"{lm[0]}-{lm[1] - 1}" if lm[1] > lm[0] else "-"
        where = str(st.stage) if par.vpp == 1 else f"{st.stage % par.pp}.{st.stage // par.pp}"
        print(
            f"{where:>5} {vit:>11} {'yes' if st.projector else '':>4} {llm:>11} "
            f"{st.forward_ms:>9.1f} {st.backward_ms:>9.1f} "
            f"{st.vit_recompute:>6}/{st.llm_recompute:<6} {st.peak_memory_gib:>8.1f}",
            file=out,
        )
    print(f"predicted step: {p.step_ms:.1f} ms (bubble {p.bubble_fraction:.1%})", file=out)
    print_levels(plan, out)
    if p.baseline is not None:
        b = p.baseline
        print(
            f"best Megatron-LM baseline: {b.step_ms:.1f} ms (bubble {b.bubble_fraction:.1%}), "
            f"the fastest of {b.configurations_fitting} configurations that fit memory (of "
            f"{b.configurations_searched}); its flags: {' '.join(b.megatron_flags)}",
            file=out,
        )
    same = p.same_parallel
    fits = "" if same.fits_memory else ", does NOT fit memory"
    print(
        f"detail: Megatron's layout at this plan's tp/pp/dp/micro-batches (ViT on stage 0, LLM "
        f"even, full recompute, padded fixed-size batches{fits}): {same.step_ms:.1f} ms, "
        f"x{same.speedup:.2f}",
        file=out,
    )
    print("megatron flags: " + " ".join(plan.megatron_flags), file=out)


def print_levels(plan, out) -> None:
    """The packing levels with their recompute and predicted step, and the epoch estimates."""
    p = plan.predicted
    if p.epoch_s is None:
        return
    if not plan.data.levels:
        print(
            f"packing levels: none pays; one level at the budgets (estimated epoch "
            f"{p.single_level_epoch_s:.1f} s)",
            file=out,
        )
        return
    change = p.epoch_s / p.single_level_epoch_s - 1 if p.single_level_epoch_s else 0.0
    print(
        f"packing levels: estimated epoch {p.epoch_s:.1f} s, one level "
        f"{p.single_level_epoch_s:.1f} s ({abs(change):.1%} {'more' if change > 0 else 'less'})",
        file=out,
    )
    print(
        f"{'level':>13} {'micro':>5} {'step ms':>10} {'steps':>6} {'samples':>8} "
        f"{'vit recompute':>14} {'llm recompute':>14} {'mem GiB':>8}",
        file=out,
    )
    for lv, pr in zip(plan.data.levels, p.levels, strict=True):
        print(
            f"{lv.vit_budget:>5}/{lv.token_budget:<7} {lv.micro_batches:>5} {pr.step_ms:>10.1f} "
            f"{pr.steps:>6} {pr.samples:>8} {','.join(map(str, lv.vit_recompute)):>14} "
            f"{','.join(map(str, lv.llm_recompute)):>14} {max(pr.peak_memory_gib):>8.1f}",
            file=out,
        )


def _vpp(text: str) -> int | None:
    """--vpp: a positive integer, or 'auto' (None: searched)."""
    if text == "auto":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or 'auto', got {text!r}"
        ) from None


def _lora(args: argparse.Namespace):
    """The LoRA of --lora-* (None without --lora-rank)."""
    from megatron_omnibal.models.lora import DEFAULT_TARGETS, LoraSpec

    if args.lora_rank is None:
        if args.lora_targets or args.lora_train:
            raise ValueError("--lora-targets / --lora-train need --lora-rank")
        return None
    names = lambda text: tuple(t.strip() for t in text.split(",") if t.strip())  # noqa: E731
    return LoraSpec(
        rank=args.lora_rank, alpha=float(2 * args.lora_rank),  # alpha prices nothing
        targets=names(args.lora_targets) if args.lora_targets else DEFAULT_TARGETS,
        train=names(args.lora_train) if args.lora_train else (),
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.models.resolve import read_mapping, resolve_model
    from megatron_omnibal.planner.cost_model.config_files import resolve_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.plan_file.plan import save_plan
    from megatron_omnibal.planner.plan_file.provenance import load_named_lengths
    from megatron_omnibal.planner.search.request import PlanRequest

    stats, lengths_path = load_named_lengths(args.lengths)
    request = PlanRequest(
        model=resolve_model(args.model),
        hardware=resolve_hardware(args.hardware),
        lengths=stats,
        lengths_path=str(lengths_path),
        gpus=args.gpus,
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        micro_batches=args.micro_batches,
        global_batch=args.global_batch,
        mode=args.mode,
        seed=args.seed,
        profile=read_mapping(args.profile) if args.profile else None,
        profile_path=str(Path(args.profile).resolve()) if args.profile else None,
        plan_path=args.out,
        levels=args.levels,
        lora=_lora(args),
        ep=args.ep,
        vit_on_first_stage=args.vit_on_first_stage,
    )
    plan = make_plan(request, progress=sys.stderr.isatty())
    save_plan(plan, args.out)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print_table(plan)
        print(f"wrote {args.out}")
    return 0
