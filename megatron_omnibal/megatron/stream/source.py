"""Where a run's samples come from: the settings the data stream needs to open its source.

They live in the stream's room (the flags build them, the stream reads them), so the data code
never reaches up into the command line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SourceSettings:
    """Where the samples come from and how their length file is read (--omnibal-data,
    --omnibal-lengths, --omnibal-tokenizer, --omnibal-text-scale, --trust-remote-code)."""

    data: str  # 'synthetic' or the dataset the length file was computed from
    lengths_path: str
    tokenizer: str | None = None
    text_scale: int = 1
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.text_scale < 1:
            raise ValueError(f"--omnibal-text-scale must be >= 1, got {self.text_scale}")
