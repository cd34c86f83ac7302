"""Reusing a prompt's attention keys/values in a later generation (prefix caching).

After a rollout step the model has already computed the keys/values of every prompt; the reflection on a finished
episode (tip writing, docs/method.md#memory) continues the episode's last prompt, so that prompt's keys/values are kept
(``PromptKV``) and the reflection only computes its new tokens. A batch mixing prompts with and without a kept
prefix is laid out as ``[left-padded prefix | left-padded rest]``: the prefix block comes from the kept caches,
the rest is fed to the model, and position ids follow the attention mask, so the padding between the two blocks
changes nothing (checked against generation from the whole prompt in ``tests/test_policy.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache


@dataclass
class PromptKV:
    """Keys/values of one prompt: ``layers[l] = (keys, values)``, each [1, kv_heads, length, head_dim]."""

    layers: list[tuple[Tensor, Tensor]]
    length: int

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def row_prompt_kv(cache, row: int, prompt_end: int, length: int) -> PromptKV:
    """Copy row ``row``'s prompt keys/values, columns ``[prompt_end - length, prompt_end)``, out of a batch cache
    (a ``transformers`` cache with ``layers[l].keys/values`` [B, kv_heads, T, head_dim]) of a left-padded batch."""
    cols = slice(prompt_end - length, prompt_end)
    return PromptKV([(layer.keys[row:row + 1, :, cols].clone(), layer.values[row:row + 1, :, cols].clone())
                     for layer in cache.layers], length)


def batch_with_prefixes(prompt_ids: list[list[int]], prefixes: list[PromptKV | None], pad_token_id: int,
                        config) -> tuple[dict[str, Tensor], DynamicCache]:
    """Inputs and cache for generating from prompts whose first ``prefixes[i].length`` ids are already cached.

    Returns ``({"input_ids", "attention_mask"} [B, T + R], cache of length T)``: T the longest prefix, R the longest
    rest. Rows without a prefix have an all-padding prefix block.

    Raises:
        ValueError: lengths differ, or a prefix covers its whole prompt (the last prompt token must be fed to get
            the first response token's logits).
    """
    if len(prefixes) != len(prompt_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(prefixes)} prefixes")
    lengths = [0 if p is None else p.length for p in prefixes]
    for i, (ids, n) in enumerate(zip(prompt_ids, lengths)):
        if n >= len(ids):
            raise ValueError(f"prefix {i} covers {n} of the prompt's {len(ids)} ids; at least one must be new")
    template = next(p for p in prefixes if p is not None)
    t_len = max(lengths)
    r_len = max(len(ids) - n for ids, n in zip(prompt_ids, lengths))
    batch = len(prompt_ids)
    input_ids = torch.full((batch, t_len + r_len), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, t_len + r_len), dtype=torch.long)
    layers = []
    for k0, v0 in template.layers:
        shape = (batch, k0.shape[1], t_len, k0.shape[3])
        layers.append((k0.new_zeros(shape), v0.new_zeros((batch, v0.shape[1], t_len, v0.shape[3]))))
    for i, (ids, n, prefix) in enumerate(zip(prompt_ids, lengths, prefixes)):
        rest = ids[n:]
        input_ids[i, t_len - n:t_len] = torch.tensor(ids[:n], dtype=torch.long)
        input_ids[i, t_len + r_len - len(rest):] = torch.tensor(rest, dtype=torch.long)
        mask[i, t_len - n:t_len] = 1
        mask[i, t_len + r_len - len(rest):] = 1
        if prefix is not None:
            for (keys, values), (k, v) in zip(layers, prefix.layers):
                keys[i, :, t_len - n:] = k[0]
                values[i, :, t_len - n:] = v[0]
    cache = DynamicCache(ddp_cache_data=layers, config=config)
    return {"input_ids": input_ids, "attention_mask": mask}, cache
