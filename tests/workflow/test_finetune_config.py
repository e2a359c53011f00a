"""`omnibal finetune`'s config file: every key checked when read, errors naming file and key."""

import pytest

from megatron_omnibal.cli import main
from megatron_omnibal.workflow.config import known_keys, load_config


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.json").write_text("[]")
    return tmp_path


def _write(folder, text):
    path = folder / "run.yaml"
    path.write_text("model: model\ndata: data.json\noutput: out\n" + text)
    return path


def test_a_minimal_config_takes_the_defaults_and_paths_from_its_folder(folder):
    config = load_config(_write(folder, "lr: 2e-5\nfreeze: [vit]\nmegatron_args: [--bf16]\n"))
    assert config.model == str(folder / "model") and config.output == str(folder / "out")
    assert config.lr == 2e-5  # YAML reads 2e-5 as a string: still a number here
    assert config.freeze == ("vit",) and config.megatron_args == ("--bf16",)
    assert (config.nodes, config.device, config.iters, config.epochs) == (1, "cuda", None, None)


def test_an_unknown_key_is_named_with_the_known_ones(folder):
    path = _write(folder, "learning_rate: 1e-5\n")
    with pytest.raises(ValueError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "'learning_rate'" in message
    assert all(key in message for key in known_keys()) and "lr" in known_keys()


@pytest.mark.parametrize(
    "text, message",
    [
        ("lr: fast\n", "lr: expected a positive number, got 'fast'"),
        ("lr: 0\n", "lr: expected a positive number"),
        ("nodes: 0\n", "nodes: expected a positive integer, got 0"),
        ("gpus_per_node: 2.5\n", "gpus_per_node: expected a positive integer"),
        ("tp: true\n", "tp: expected a positive integer, got True"),
        ("device: tpu\n", "device: expected cuda or cpu, got 'tpu'"),
        ("freeze: [vision]\n", "freeze: expected a list of vit, projector, llm"),
        ("freeze: vit\n", "freeze: expected a list"),
        ("megatron_args: --bf16\n", "megatron_args: expected a list of strings"),
        ("megatron_args: [--lr, 1]\n", "megatron_args: expected a list of strings"),
        ("iters: 10\nepochs: 1\n", "iters and epochs: give one of them"),
        ("min_lr: 1\n", "min_lr: expected a number from 0 to lr"),
        ("warmup: 2.5\n", "warmup: expected a fraction below 1 or a whole number"),
        ("seed: -1\n", "seed: expected a non-negative integer"),
        ("image_root: nowhere\n", "image_root: no such folder"),
        ("hardware: [H100]\n", "hardware: expected a preset name or a file"),
        ("template: chatml\n", "template: expected one of internvl2_5, vicuna_v1, qwen2_vl, hf, "
                                "got 'chatml'"),
    ],
)
def test_a_bad_value_is_named_with_its_key_and_file(folder, text, message):
    path = _write(folder, text)
    with pytest.raises(ValueError) as err:
        load_config(path)
    assert str(path) in str(err.value) and message in str(err.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("model: model\ndata: data.json\n", "missing key(s) output"),
        ("- a list\n", "expected a mapping"),
        ("model: nowhere\ndata: data.json\noutput: out\n", "model: "),
        ("model: model\ndata: none.json\noutput: out\n", "data: no such file"),
    ],
)
def test_missing_keys_and_paths_are_named(folder, text, message):
    path = folder / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_the_command_reports_a_bad_config_as_a_usage_error(folder, capsys):
    path = _write(folder, "lrr: 1\n")
    assert main(["finetune", str(path), "--dry-run"]) == 2
    assert "'lrr'" in capsys.readouterr().err
    assert not (folder / "out").exists()


def test_from_after_until_is_a_usage_error(folder, capsys):
    path = _write(folder, "")
    assert main(["finetune", str(path), "--from", "train", "--until", "plan"]) == 2
    assert "--from train comes after --until plan" in capsys.readouterr().err
    assert not (folder / "out").exists()


@pytest.mark.parametrize(
    "text, message",
    [
        ("lora: {alpha: 8}\n", "lora.rank: expected a positive integer, got None"),
        ("lora: {rank: 4, ranks: 2}\n", "lora: unknown key(s) 'ranks' (known: rank, alpha"),
        ("lora: {rank: 4, dropout: 1.5}\n", "lora: LoRA dropout must be in [0, 1), got 1.5"),
        ("lora: {rank: 4, targets: 7}\n", "lora.targets: expected a list of names, got 7"),
        ("lora: 8\n", "lora: expected a mapping with rank"),
    ],
)
def test_a_bad_lora_setting_is_named(folder, text, message):
    path = _write(folder, text)
    with pytest.raises(ValueError) as err:
        load_config(path)
    assert str(path) in str(err.value) and message in str(err.value)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A folder whose model is a real (tiny) InternVL checkpoint."""
    from tests.helpers import hf_models

    folder = tmp_path_factory.mktemp("lora_config")
    hf_models.internvl(folder / "model", six_b=False)
    (folder / "data.json").write_text("[]")
    return folder


def test_lora_takes_the_flags_defaults_and_is_checked_against_the_model(vlm):
    config = load_config(_write(vlm, "lora: {rank: 8, targets: 'linear_qkv, vit.*'}\n"))
    lora = config.lora_spec
    assert (lora.rank, lora.alpha, lora.dropout) == (8, 32.0, 0.05)
    assert lora.targets == ("linear_qkv", "vit.*") and lora.train == ()
    for text, message in (
        ("lora: {rank: 4, targets: [q_proj]}\n",
         "lora.targets: 'q_proj' matches no layer of the model"),
        ("lora: {rank: 64}\n", "lora.rank 64 is above the width of llm.layers.0"),
        ("freeze: [llm]\nlora: {rank: 4}\n", "lora.targets: LoRA on llm.layers.0.mlp.linear_fc1, "
         "but the LLM is frozen by --omnibal-freeze llm"),
        ("freeze: [projector]\nlora: {rank: 4, train: [projector]}\n",
         "lora.train projector: the part is frozen by --omnibal-freeze projector"),
    ):  # fmt: skip
        path = _write(vlm, text)
        with pytest.raises(ValueError) as err:
            load_config(path)
        assert str(path) in str(err.value) and message in str(err.value), str(err.value)
