"""Tokens per expert, counted from the routers' choices: how evenly a mixture-of-experts LLM
spreads its work over the experts (and so over expert-parallel ranks) in a step.

Why: an unbalanced router makes the expert-parallel rank holding the busiest expert the
straggler of every all-to-all, much as an unbalanced micro-batch makes one pipeline stage the
straggler; the step's max/mean over experts says how much. Counted by forward hooks on
megatron-core's routers (their routing map), so nothing in the layers changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class ExpertLoad:
    """Tokens routed to each expert of every MoE layer of the stages added (one rank's model
    chunks) since the last `take()`, by global layer index. Only forwards with gradients
    enabled count: under full recompute the first pass runs without them and the recompute
    routes again with them, so each token counts once either way. Each rank counts its own
    tokens: summed over the data- and (sequence-parallel) tensor-parallel ranks they are the
    step's."""

    def __init__(self, stages: list[Any] = ()) -> None:
        self.counts: dict[int, torch.Tensor] = {}
        for stage in stages:
            self.add(stage)

    def add(self, stage: Any) -> None:
        """Count the routers of `stage`'s LLM layers (a stage without any adds nothing)."""
        block = getattr(stage, "llm", None)
        for layer in getattr(block, "layers", ()):
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, index: int) -> Any:
        def count(_module: Any, _args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            if not torch.is_grad_enabled():
                return
            routing_map = output[1]
            tokens = routing_map.detach().sum(dim=0).to(torch.float64).cpu()
            seen = self.counts.get(index)
            self.counts[index] = tokens if seen is None else seen + tokens

        return count

    def take(self) -> dict[int, torch.Tensor]:
        """The counts since the last call (this rank's tokens only), and start again."""
        counts, self.counts = self.counts, {}
        return counts


    def step_tokens(self, num_layers: int, num_experts: int) -> np.ndarray:
        """[layers, experts] tokens of the whole step, every rank's counts summed (a collective:
        every rank calls it at the same point of each step), and start again. Each rank counts
        only the tokens it routed, so the sum over all ranks is the step's (pipeline stages
        hold other layers, data- and sequence-parallel ranks other tokens)."""
        device = torch.device("cuda", torch.cuda.current_device()) if (
            torch.cuda.is_available()) else torch.device("cpu")  # fmt: skip
        table = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        for layer, tokens in self.take().items():
            table[layer] = tokens.to(device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(table)
        return table.cpu().numpy()
