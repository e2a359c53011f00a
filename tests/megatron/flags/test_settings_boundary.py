"""Below the entry points the Megatron layer receives the run's settings, never Megatron's
argument namespace: an ast scan of every module of the Megatron layer and the preflight.

Only the entry modules (they parse the command line, build the settings and hand the namespace
to megatron.training) may call megatron.training's get_args() or take a parameter `args`, and
a Megatron callback whose signature Megatron fixes is listed by name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "megatron_omnibal"
SCANNED = ("megatron", "preflight")  # the Megatron layer and the tool built on its entry point
ENTRY_MODULES = {
    "megatron_omnibal.megatron.training.pretrain_vlm",  # parses, validates, trains
    "megatron_omnibal.megatron.flags.args",  # the --omnibal* flags -> OmnibalSettings
    "megatron_omnibal.megatron.flags.prepare",  # pretrain_vlm's start-up checks
    "megatron_omnibal.megatron.flags.optimizer_args",  # Megatron's optimizer flags checked
    "megatron_omnibal.megatron.flags.moe_args",  # Megatron's MoE flags checked
    "megatron_omnibal.megatron.training.lora_checkpoints",  # wraps Megatron's load and save
    "megatron_omnibal.preflight.run",  # the preflight's entry on pretrain_vlm
}
# (module, function): Megatron calls these with its namespace.
MEGATRON_CALLBACKS = {("megatron_omnibal.megatron.stages.finetune", "with_vit_override")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_namespace(arg: ast.arg) -> bool:
    """A parameter `args` that may be the namespace: unannotated, Any or a Namespace (a hook's
    `args: tuple` of positional arguments is not)."""
    if arg.arg != "args":
        return False
    return arg.annotation is None or any(
        name in ast.unparse(arg.annotation) for name in ("Namespace", "Any")
    )


def violations() -> list[str]:
    found = []
    for tower in SCANNED:
        for path in sorted((PACKAGE / tower).rglob("*.py")):
            module = _module_name(path)
            if module in ENTRY_MODULES:
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    func = node.func
                    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if name == "get_args":
                        found.append(f"{module}:{node.lineno} calls get_args()")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    fn = getattr(node, "name", "<lambda>")
                    params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                    if (module, fn) not in MEGATRON_CALLBACKS and any(map(_is_namespace, params)):
                        found.append(f"{module}:{node.lineno} {fn}() takes `args`")
    return found


def test_no_module_below_the_entry_points_reads_megatrons_namespace() -> None:
    assert violations() == []


def test_the_scan_finds_what_it_forbids(tmp_path, monkeypatch) -> None:
    """The scan itself can fail: a module that calls get_args() and one that takes `args`."""
    fake = tmp_path / "megatron_omnibal"
    (fake / "megatron").mkdir(parents=True)
    (fake / "preflight").mkdir()
    (fake / "megatron" / "reads.py").write_text(
        "from megatron.training import get_args\n\ndef f():\n    return get_args().seed\n"
    )
    (fake / "preflight" / "takes.py").write_text("def g(args, x: int):\n    return args.seed\n")
    (fake / "megatron" / "hook.py").write_text("def h(_, args: tuple, kwargs: dict):\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert violations() == [
        "megatron_omnibal.megatron.reads:4 calls get_args()",
        "megatron_omnibal.preflight.takes:1 g() takes `args`",
    ]
