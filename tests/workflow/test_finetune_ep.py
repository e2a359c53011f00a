"""`omnibal finetune`'s `ep`: checked against the model when the config is read (it must divide
the LLM's experts; a dense LLM has none) and handed to the plan, which the conversion and the
training follow."""

import pytest

from megatron_omnibal.workflow.config import load_config
from megatron_omnibal.workflow.paths import OutputPaths
from megatron_omnibal.workflow.steps import build_step


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Real tiny checkpoints: a Qwen3-MoE InternVL (4 experts) and a dense one."""
    from tests.helpers import hf_models

    folder = tmp_path_factory.mktemp("ep_config")
    hf_models.internvl(folder / "moe", six_b=False, text="qwen3_moe", llm_layers=2)
    hf_models.internvl(folder / "dense", six_b=False, llm_layers=2)
    (folder / "data.json").write_text("[]")
    return folder


def _write(folder, model, text):
    path = folder / "run.yaml"
    path.write_text(f"model: {model}\ndata: data.json\noutput: out\n" + text)
    return path


def test_ep_goes_to_the_plan(folder):
    config = load_config(_write(folder, "moe", "ep: 2\ntp: 1\n"))
    assert config.ep == 2
    command = build_step("plan", config, OutputPaths(config.out)).command
    assert command[command.index("--ep") + 1] == "2"
    unset = load_config(_write(folder, "moe", ""))
    assert unset.ep is None
    assert "--ep" not in build_step("plan", unset, OutputPaths(unset.out)).command


@pytest.mark.parametrize(
    "model, text, message",
    [
        ("moe", "ep: 3\n", "ep: expert parallel size 3 does not divide the LLM's 4 experts"),
        ("moe", "ep: 0\n", "ep: expected a positive integer, got 0"),
        ("dense", "ep: 2\n", "ep: expert parallel size 2: the LLM has no experts"),
    ],
)
def test_a_bad_ep_is_named_with_the_file(folder, model, text, message):
    path = _write(folder, model, text)
    with pytest.raises(ValueError) as err:
        load_config(path)
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)
