"""A sample's text by its chat template: one path for `omnibal stats` and training.

Both build a `SampleText` from the stored configuration and render every sample through it, so
the tokens stats counts are the tokens training encodes, and a template (or a record) that
cannot be trained is refused by both with the same words: at construction (the template) or per
record (`SampleError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_omnibal.data.text import conversations as conv
from megatron_omnibal.data.text.chat_template import HfChatTemplate

if TYPE_CHECKING:
    from megatron_omnibal.data.sample.config import StatsConfig
    from megatron_omnibal.data.text.tokenization import TokenCounter


class SampleText:
    """Renders (role, text) turns with their images and videos by the configured template."""

    def __init__(self, config: StatsConfig, counter: TokenCounter) -> None:
        self.template, self.system = config.template, config.system
        self.hf = (HfChatTemplate(counter.hf, str(counter.path), config.image_style,
                                  config.system) if config.template == "hf" else None)

    @property
    def template_sha(self) -> str | None:
        """A hash of the checkpoint's chat template (None for a built-in template)."""
        return None if self.hf is None else self.hf.sha

    def render(self, turns: list[tuple[str, str]], media: Sequence[conv.Media]) -> conv.ChatText:
        """The sample's text pieces and answer spans; `media`: its images (or videos) in the
        order of their placeholders."""
        if self.hf is not None:
            return self.hf.render(turns, media)
        return conv.render(conv.expand_media(turns, media), self.template, self.system)
