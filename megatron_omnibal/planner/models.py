"""Model presets: the layer shapes of the vision encoder, projector and LLM.

These are the only model facts the planner uses; the same dict is written to plan.json as
`model_spec`, from which the Megatron side builds the model. Each preset names the config file
its numbers come from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ViTSpec:
    """A ViT tower: every layer sees one tile as `num_patches (+ class token)` tokens."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    norm: str = "layernorm"
    class_token: bool = True

    @property
    def seq_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + int(self.class_token)

    @property
    def layer_params(self) -> int:
        h = self.hidden_size
        return 4 * h * h + 2 * h * self.ffn_hidden_size + 9 * h  # qkv+proj, fc1+fc2, biases/norms


@dataclass(frozen=True)
class ProjectorSpec:
    """Vision-to-language bridge: optional pixel shuffle, then a two-layer MLP."""

    type: str = "pixel_shuffle_mlp"
    downsample: float = 0.5
    hidden_size: int = 0  # MLP width (0: the LLM's hidden size); its output width is the LLM's


@dataclass(frozen=True)
class LLMSpec:
    """A decoder-only LLM with (grouped-query) attention and a SwiGLU or GELU MLP."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    norm: str = "rmsnorm"
    gated_mlp: bool = True

    @property
    def kv_size(self) -> int:
        return self.hidden_size // self.num_attention_heads * self.num_query_groups

    @property
    def layer_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        mlp = (3 if self.gated_mlp else 2) * h * f
        return 2 * h * h + 2 * h * self.kv_size + mlp + 2 * h


@dataclass(frozen=True)
class ModelSpec:
    """A vision-language model: [patch embed, ViT layers, projector, LLM layers, head]."""

    name: str
    vit: ViTSpec
    projector: ProjectorSpec
    llm: LLMSpec
    source: str = ""
    tokens_per_tile: int = field(default=0)

    def __post_init__(self) -> None:
        if self.tokens_per_tile <= 0:
            patches = (self.vit.image_size // self.vit.patch_size) ** 2
            pixel = self.projector.type.startswith("pixel")
            shrink = self.projector.downsample**2 if pixel else 1
            object.__setattr__(self, "tokens_per_tile", int(round(patches * shrink)))

    @property
    def projector_in(self) -> int:
        """Width entering the projector MLP (pixel shuffle folds patches into channels)."""
        if self.projector.type.startswith("pixel"):
            return int(round(self.vit.hidden_size / self.projector.downsample**2))
        return self.vit.hidden_size

    @property
    def projector_hidden(self) -> int:
        return self.projector.hidden_size or self.llm.hidden_size

    @property
    def projector_params(self) -> int:
        i, m, o = self.projector_in, self.projector_hidden, self.llm.hidden_size
        return i * m + m * o + 2 * i + m + o

    @property
    def patch_embed_params(self) -> int:
        v = self.vit
        return 3 * v.patch_size**2 * v.hidden_size + (v.seq_per_tile + 1) * v.hidden_size

    def spec_dict(self) -> dict:
        """The plan.json `model_spec` block."""
        vit = asdict(self.vit)
        vit.pop("class_token")
        llm = asdict(self.llm)
        llm.pop("gated_mlp")
        proj = asdict(self.projector)
        proj["hidden_size"] = self.projector_hidden
        return {
            "vit": vit,
            "projector": proj,
            "llm": llm,
            "tokens_per_tile": self.tokens_per_tile,
            "vit_class_token": self.vit.class_token,
            "llm_gated_mlp": self.llm.gated_mlp,
        }


# HF OpenGVLab/InternViT-6B-448px-V1-5 config.json: num_hidden_layers 45, hidden_size 3200,
# intermediate_size 12800, num_attention_heads 25, image_size 448, patch_size 14, rms_norm.
# (InternViT-6B-448px-V1-2, used by InternVL-Chat-V1-2, has the same 45-layer shape.)
_INTERNVIT_6B = ViTSpec(45, 3200, 12800, 25, 448, 14, "rmsnorm")
# HF OpenGVLab/InternViT-300M-448px config.json: 24 layers, 1024 hidden, 4096 MLP, 16 heads.
_INTERNVIT_300M = ViTSpec(24, 1024, 4096, 16, 448, 14, "layernorm")
# HF openai/clip-vit-large-patch14-336 vision_config: 24 layers, 1024, 4096, 16 heads, 336/14.
_CLIP_L_336 = ViTSpec(24, 1024, 4096, 16, 336, 14, "layernorm")

MODELS: dict[str, ModelSpec] = {
    "internvl-6b-20b": ModelSpec(
        "internvl-6b-20b",
        _INTERNVIT_6B,
        ProjectorSpec("pixel_shuffle_mlp", 0.5, 6144),
        # HF OpenGVLab/InternVL-Chat-V1-5 llm_config (InternLM2-chat-20B): 48 layers, hidden 6144,
        # intermediate 16384, 48 heads, 8 KV heads, vocab 92553; mlp1 = LN, 12800->6144, GELU,
        # 6144->6144 after pixel shuffle with downsample_ratio 0.5 (256 tokens per 448px tile).
        LLMSpec(48, 6144, 16384, 48, 8, 92553),
        source="OpenGVLab/InternVL-Chat-V1-5 (the OmniBal paper's 6+20B)",
    ),
    "internvl-6b-34b": ModelSpec(
        "internvl-6b-34b",
        _INTERNVIT_6B,
        ProjectorSpec("pixel_shuffle_mlp", 0.5, 7168),
        # HF NousResearch/Nous-Hermes-2-Yi-34B config.json: 60 layers, hidden 7168,
        # intermediate 20480, 56 heads, 8 KV heads, vocab 64000 (InternVL-Chat-V1-2's LLM).
        LLMSpec(60, 7168, 20480, 56, 8, 64000),
        source="OpenGVLab/InternVL-Chat-V1-2 (the OmniBal paper's 6+34B)",
    ),
    "llava-1.5-7b": ModelSpec(
        "llava-1.5-7b",
        _CLIP_L_336,
        ProjectorSpec("mlp", 1.0, 4096),
        # HF lmsys/vicuna-7b-v1.5 config.json: 32 layers, 4096, 11008, 32 heads (MHA), vocab
        # 32000; LLaVA-1.5 mlp2x_gelu projector 1024->4096->4096, 576 tokens per 336px image.
        LLMSpec(32, 4096, 11008, 32, 32, 32000),
        source="liuhaotian/llava-v1.5-7b",
    ),
    "llava-1.5-13b": ModelSpec(
        "llava-1.5-13b",
        _CLIP_L_336,
        ProjectorSpec("mlp", 1.0, 5120),
        # HF lmsys/vicuna-13b-v1.5 config.json: 40 layers, 5120, 13824, 40 heads, vocab 32000.
        LLMSpec(40, 5120, 13824, 40, 40, 32000),
        source="liuhaotian/llava-v1.5-13b",
    ),
    "internvl2-8b": ModelSpec(
        "internvl2-8b",
        _INTERNVIT_300M,
        ProjectorSpec("pixel_shuffle_mlp", 0.5, 4096),
        # HF OpenGVLab/InternVL2-8B llm_config (InternLM2.5-7B-chat): 32 layers, 4096, 14336,
        # 32 heads, 8 KV heads, vocab 92553; mlp1 4096->4096->4096 after pixel shuffle.
        LLMSpec(32, 4096, 14336, 32, 8, 92553),
        source="OpenGVLab/InternVL2-8B",
    ),
    # A toy model for tests and CPU dry runs: 56px tiles of 14px patches, 4 tokens per tile.
    "tiny": ModelSpec(
        "tiny",
        ViTSpec(4, 64, 256, 4, 56, 14, "layernorm"),
        ProjectorSpec("pixel_shuffle_mlp", 0.5, 64),
        LLMSpec(4, 64, 176, 4, 2, 512),
        source="test model",
    ),
}


def get_model(name: str) -> ModelSpec:
    """The preset `name`, or a clear error listing the known ones."""
    if name not in MODELS:
        raise ValueError(
            f"unknown model preset '{name}' (known: {', '.join(MODELS)}; "
            "or give a JSON/YAML file describing the model)"
        )
    return MODELS[name]
