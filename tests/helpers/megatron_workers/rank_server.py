"""One interpreter per pytest process that imported the training stack once and forks every
local-ranks launch of the Megatron tests from there (launch.py run_ranks).

Why: megatron/runtime/local_ranks.py forks a launch's ranks from one interpreter, but each
launch is a new interpreter importing torch and megatron-core again (about 4.5 CPU s), and each
rank then imports transformers for megatron.training's tokenizer (about 2.5 CPU s). Here both
are imported once; a launch is a fork of this process that runs local_ranks.launch(), so its
ranks start from the same state a local_ranks launcher gives them.

Protocol, one JSON line per launch on stdin: {"nproc", "program" (SCRIPT ARGS... or -m MODULE
ARGS..., as local_ranks takes it), "env", "cwd", "stdout", "stderr"}; answered by {"pid":
launcher pid} (a session of its own, so the client can kill it and its ranks), then {"code":
exit status}. Exits at the end of stdin.
"""

from __future__ import annotations

import json
import os
import sys

# What every training rank imports after its start (pretrain_vlm's lazy imports; torch._dynamo:
# torch.optim's first optimizer; transformers: megatron.training's tokenizer build).
PRELOAD = (
    "torch._dynamo",
    "megatron.core.tokenizers.text.libraries",
    "megatron_omnibal.megatron.training.pretrain_vlm",
    "megatron_omnibal.megatron.stream.iterators",
    "megatron_omnibal.megatron.training.throughput",
    "megatron_omnibal.megatron.training.training_log",
    "megatron_omnibal.megatron.stream.data",
    "megatron_omnibal.megatron.stream.loader",
    "megatron_omnibal.megatron.stages.provider",
    "megatron_omnibal.preflight.run",
)


def _preload() -> dict[str, str]:
    """Import the training stack; the environment variables that set (enable_cpu_megatron's
    defaults), which a local_ranks launcher sets in its own environment."""
    import argparse
    import importlib

    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
    from megatron_omnibal.megatron.runtime.notes import quiet_fallback_warnings

    before = dict(os.environ)
    quiet_fallback_warnings()
    enable_cpu_megatron()
    for name in PRELOAD:
        importlib.import_module(name)
    from megatron.training.arguments import add_megatron_arguments

    add_megatron_arguments(argparse.ArgumentParser())  # its help texts, read once (cpu.py)
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def _launch(request: dict, defaults: dict[str, str]) -> None:
    """The forked launcher: the request's environment (over the preload's defaults) and output
    files, then local_ranks."""
    from megatron_omnibal.megatron.runtime import local_ranks

    os.setsid()
    os.environ.clear()
    os.environ.update({**defaults, **request["env"]})
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    code = 1
    try:
        nproc, module, script, args = local_ranks.parse(
            ["--nproc-per-node", str(request["nproc"]), *request["program"]])
        code = local_ranks.launch(nproc, module, script, args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    defaults = _preload()
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        answers.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _launch(request, defaults)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
