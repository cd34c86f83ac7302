"""A bf16 copy of the policy's weights for the decoding steps (``model.policy.rollout_precision`` with bf16 decoding).

A decoding step multiplies a few rows by every weight matrix, so its time is the weights' bytes, which bf16 weights
halve. Autocast gives that only where it caches its casts (trainable weights inside one enclosing autocast region);
frozen weights, as in evaluation, it casts again at every step. On the 2-core Xeon with AMX of docs/performance.md a
SmolLM2 step for 8 rows at 900 tokens of context took ~68 ms with a bf16 copy against ~125 ms with the fp32 weights
and ~118 ms under autocast with frozen weights. The copy holds only the parameters whose
dtype differs (a bf16 LoRA base is shared, not copied) and keeps the buffers as they are (rotary frequencies stay fp32:
a bf16 ``inv_freq`` would shift the phase of late positions by radians).

It is refreshed from the live weights at every ``generate`` call (``refreshed``): 42 ms for SmolLM2's 135 M
parameters on that Xeon, ~1 % of an 8-row rollout step's generation, so no update path leaves its values stale (a
fused optimizer and ``.data`` writes change weights without bumping the version counters a cheaper check reads). It is
rebuilt when anything else it mirrors changes: another model, a parameter object replaced, a shape, device or dtype,
or a PEFT layer's adapter state (merged, disabled, which adapters are active).
"""
from __future__ import annotations

import copy

import torch
from torch import nn


class InferenceCopy:
    """The copy of one model in ``dtype``, built at first use on the model's device and rebuilt when what it mirrors
    changes (the module docstring says what). Not a submodule of its owner: never in a state dict or an optimizer."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self.source: nn.Module | None = None
        self.model: nn.Module | None = None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the copy's tensor, the live parameter it mirrors)
        self.layout: list[tuple] = []

    def __deepcopy__(self, memo) -> "InferenceCopy":
        return InferenceCopy(self.dtype)  # a copied policy builds its own copy of its own weights

    def refreshed(self, model: nn.Module) -> nn.Module:
        """``model`` itself where every parameter is already ``dtype``, else the copy with the live weights now.

        The copy has the model's modules, hooks and config, ``requires_grad=False`` parameters, and is in eval mode.
        """
        live = list(model.parameters())
        if all(p.dtype == self.dtype for p in live):
            return model
        layout = [(id(p), p.shape, p.device, p.dtype) for p in live] + adapter_state(model)
        if self.source is not model or layout != self.layout:
            self._build(model, live)
            self.layout = layout
        with torch.no_grad():
            for mine, p in self.pairs:
                mine.copy_(p)
        return self.model

    def _build(self, model: nn.Module, live: list[nn.Parameter]) -> None:
        self.model = self.source = None  # the old copy's memory first
        memo, self.pairs = {}, []
        for p in live:  # a tied parameter appears once, and stays tied in the copy through the memo
            if p.dtype == self.dtype:
                memo[id(p)] = p  # shared, not copied: always the live value
                continue
            mine = nn.Parameter(torch.empty(p.shape, dtype=self.dtype, device=p.device), requires_grad=False)
            memo[id(p)] = mine
            self.pairs.append((mine, p))
        self.model = copy.deepcopy(model, memo).eval()
        self.source = model


def adapter_state(model: nn.Module) -> list[tuple]:
    """Each PEFT LoRA layer's (merged, adapters disabled, active adapters): flags a copy does not follow by itself."""
    return [(bool(getattr(m, "merged", False)), bool(getattr(m, "disable_adapters", False)),
             tuple(getattr(m, "active_adapters", ()))) for m in model.modules() if hasattr(m, "merged_adapters")]
