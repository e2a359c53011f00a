"""How `omnibal stats` measured a dataset, stored in the length file and checked by training.

A length file is only right for the tiling, chat template, tokenizer and image-token layout it
was counted with. `omnibal stats` writes that whole configuration into the file it produces; the
training loader rebuilds the same configuration from it (instead of re-parsing command-line
flags) and checks it against the model: tile size, tokens per tile, the image start/end/context
token ids, and a fingerprint of the tokenizer. A mismatch stops the run before any process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_omnibal.data.frames import FrameSettings
from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.data.text import conversations as conv

CONFIG_VERSION = 1


class StatsConfigError(ValueError):
    """A stored configuration that cannot be read, or that does not fit the model."""


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """What the model makes of one image: its name, tile size, tokens per tile, token ids."""

    name: str
    image_size: int
    tokens_per_tile: int
    image_token_id: int
    image_start_id: int = -1
    image_end_id: int = -1
    vocab_size: int = 0

    @classmethod
    def from_spec(cls, spec: Any) -> ModelLayout:
        return cls(name=spec.name, image_size=spec.vit.image_size,
                   tokens_per_tile=spec.tokens_per_tile, image_token_id=spec.image_token_id,
                   image_start_id=spec.image_start_id, image_end_id=spec.image_end_id,
                   vocab_size=spec.llm.vocab_size)


@dataclass(frozen=True, kw_only=True)
class StatsConfig:
    """What the model does with a sample: tokenizer, chat template, image tiling, records."""

    tokenizer: str
    tiling: TilingConfig = field(default_factory=TilingConfig)
    template: str = "internvl2_5"
    image_style: conv.ImageStyle = conv.INTERNVL_IMAGE
    system: str | None = None  # None: the template's default system message
    dummy_tile: bool = True  # a text-only sample still runs one blank tile through the ViT
    max_tokens: int | None = None
    trust_remote_code: bool = False  # run a tokenizer directory's own Python code
    verify_images: bool = False  # decode every image fully (not only its header)
    extra_keys: tuple[str, ...] = ()  # record keys that carry no content, beyond the known ones
    frames: FrameSettings = field(default_factory=FrameSettings)  # frames per video
    frame_seed: int = 0  # the length records count the frames of epoch 0 of this seed
    # a native-resolution model's videos (Qwen2.5-VL: its fixed rate and sizes, not `frames`)
    native_video: NativeVideoSettings = field(default_factory=NativeVideoSettings)
    model: ModelLayout | None = None

    def __post_init__(self) -> None:
        if self.template not in conv.TEMPLATES:
            raise ValueError(f"unknown template {self.template!r} "
                             f"(choose from {', '.join(conv.TEMPLATES)})")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        m = self.model
        if m is not None and self.tiling.mode != "anyres" and (
                self.tiling.tile != m.image_size or self.tiling.tokens_per_tile
                != m.tokens_per_tile):
            raise ValueError(
                f"tiling of {self.tiling.tile}-pixel tiles with {self.tiling.tokens_per_tile} "
                f"tokens per tile, but model {m.name} has {m.image_size}-pixel tiles with "
                f"{m.tokens_per_tile} tokens per tile")


def config_to_dict(config: StatsConfig, run: dict[str, Any]) -> dict[str, Any]:
    """The JSON form stored in a length file; `run` adds facts of the run (tokenizer
    fingerprint and image token ids, dataset path, image root)."""
    doc = dataclasses.asdict(config)
    doc["tiling"]["pinpoints"] = [list(p) for p in config.tiling.pinpoints]
    doc["extra_keys"] = list(config.extra_keys)
    return {"version": CONFIG_VERSION, **doc, **run}


def config_from_dict(doc: Any, where: str) -> tuple[StatsConfig, dict[str, Any]]:
    """(config, run facts) from a stored configuration; errors name the file and the key."""
    if not isinstance(doc, dict):
        raise StatsConfigError(f"{where}: stored stats configuration is not an object")
    if doc.get("version") != CONFIG_VERSION:
        raise StatsConfigError(f"{where}: stats configuration version {doc.get('version')!r}, "
                               f"expected {CONFIG_VERSION} (rerun `omnibal stats`)")
    known = {f.name for f in dataclasses.fields(StatsConfig)}
    try:
        kwargs = {k: doc[k] for k in known if k in doc}
        tiling = dict(kwargs.pop("tiling"))
        tiling["pinpoints"] = tuple(tuple(p) for p in tiling.get("pinpoints", ()))
        for key in ("image_mean", "image_std"):
            if tiling.get(key) is not None:
                tiling[key] = tuple(tiling[key])
        kwargs["tiling"] = TilingConfig(**tiling)
        kwargs["image_style"] = conv.ImageStyle(**kwargs["image_style"])
        kwargs["extra_keys"] = tuple(kwargs.get("extra_keys", ()))
        if kwargs.get("model") is not None:
            kwargs["model"] = ModelLayout(**kwargs["model"])
        if kwargs.get("frames") is not None:  # absent in files written before videos
            kwargs["frames"] = FrameSettings(**kwargs["frames"])
        if kwargs.get("native_video") is not None:  # absent in files before Qwen videos
            kwargs["native_video"] = NativeVideoSettings(**kwargs["native_video"])
        config = StatsConfig(**kwargs)
    except (KeyError, TypeError, ValueError) as exc:
        raise StatsConfigError(f"{where}: stored stats configuration is incomplete or invalid "
                               f"({type(exc).__name__}: {exc})") from exc
    run = {k: v for k, v in doc.items() if k not in known and k != "version"}
    return config, run


def data_tokens_per_tile(doc: dict[str, Any] | None) -> int | None:
    """Image tokens per real tile counted in token_num (None: not stored)."""
    if not doc:
        return None
    value = (doc.get("tiling") or {}).get("tokens_per_tile")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_model(config: StatsConfig, run: dict[str, Any], spec: Any, where: str) -> None:
    """Stop unless the measured configuration is what `spec` (a ModelSpec) trains on."""
    tiling, layout = config.tiling, ModelLayout.from_spec(spec)
    problems = []
    native = spec.vit.native_resolution
    if native and tiling.mode != "native":
        problems.append(f"tiling mode {tiling.mode!r} (the model sees images at their own "
                        "resolution: native tiling)")
    elif not native and tiling.mode not in ("dynamic", "fixed"):
        problems.append(f"tiling mode {tiling.mode!r} (the model takes tokens_per_tile tokens "
                        "per tile, which only dynamic and fixed tiling give)")
    if tiling.tile != layout.image_size:
        problems.append(f"{tiling.tile}-pixel tiles, the model's are {layout.image_size}")
    if tiling.tokens_per_tile != layout.tokens_per_tile:
        problems.append(f"{tiling.tokens_per_tile} tokens per tile, the model's are "
                        f"{layout.tokens_per_tile}")
    ids = run.get("image_token_ids") or {}
    for part, model_id in (("start", layout.image_start_id), ("end", layout.image_end_id)):
        text = getattr(config.image_style, part)
        if model_id >= 0 and not text:
            problems.append(f"the model wraps images in image_{part}_id {model_id}, the data "
                            f"has no image {part} token")
        elif model_id >= 0 and ids.get(part) != model_id:
            problems.append(f"image {part} token {text!r} has id {ids.get(part)} in the "
                            f"tokenizer, the model's image_{part}_id is {model_id}")
    if problems:
        raise StatsConfigError(f"{where} was counted for another model than {layout.name}: "
                               + "; ".join(problems)
                               + " (rerun `omnibal stats --model` with this model)")
