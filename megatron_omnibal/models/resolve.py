"""`--model NAME|FILE|HF_DIR`: a preset, a model_spec JSON/YAML file, or a Hugging Face
checkpoint directory (its config.json), resolved to one ModelSpec."""

from __future__ import annotations

from pathlib import Path

from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.spec import ModelSpec


def read_mapping(path: str | Path) -> dict:
    """Parse a JSON or YAML mapping (YAML by suffix .yaml/.yml); errors name the file."""
    import json

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parser error becomes one clear message
        raise ValueError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return doc


def resolve_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name, a model_spec JSON/YAML file, or an HF checkpoint directory."""
    path = Path(name_or_path)
    if path.is_dir():
        from megatron_omnibal.models.hf_config import spec_from_hf

        return spec_from_hf(path)
    if path.suffix in (".json", ".yaml", ".yml"):
        doc = read_mapping(path)
        doc.setdefault("name", path.stem)
        return ModelSpec.from_dict(doc, str(path))
    return get_preset(str(name_or_path))
