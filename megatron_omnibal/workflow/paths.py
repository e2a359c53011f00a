"""Where each file of a fine-tuning run goes, under the config's `output` directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's marker of a checkpoint directory


@dataclass(frozen=True)
class OutputPaths:
    root: Path

    @property
    def lengths(self) -> Path:
        return self.root / "lengths.npz"

    @property
    def stats_png(self) -> Path:
        return self.root / "stats.png"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def start_checkpoint(self) -> Path:
        return self.root / "checkpoints" / "start"

    @property
    def preflight(self) -> Path:
        return self.root / "preflight.json"

    @property
    def train_checkpoint(self) -> Path:
        return self.root / "checkpoints" / "train"

    @property
    def export(self) -> Path:
        return self.root / "hf"

    @property
    def adapter(self) -> Path:
        """A LoRA run's PEFT adapter (the merged model is `export`)."""
        return self.root / "hf-adapter"

    @property
    def compare(self) -> Path:
        return self.root / "compare_hf.json"

    @property
    def launch(self) -> Path:
        return self.root / "launch"

    def log(self, step: str) -> Path:
        return self.root / "logs" / f"{step}.log"

    def state(self, step: str) -> Path:
        return self.root / "state" / f"{step}.json"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    @property
    def loss_png(self) -> Path:
        return self.root / "loss.png"

    @property
    def balance_png(self) -> Path:
        return self.root / "balance.png"


def checkpoint_iteration(directory: Path) -> int | None:
    """The iteration Megatron's tracker names (None: no checkpoint; release counts as 0)."""
    tracker = directory / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return 0 if text == "release" else int(text) if text.isdigit() else None
