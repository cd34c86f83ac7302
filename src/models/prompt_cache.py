"""Reusing a prompt's attention keys/values in a later generation (prefix caching): a reflection continues its
episode's last prompt (docs/method.md#memory), and the episodes of a task share their prompts' beginning. A batch
mixing prompts with and without a kept prefix is laid out as ``[left-padded prefix | left-padded rest]``; position
ids follow the attention mask, so the padding between the blocks changes nothing (tests/test_policy.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from src.models.prefix_tree import common_prefix


@dataclass
class PromptKV:
    """Keys/values of one prompt: ``layers[l] = (keys, values)``, each [1, kv_heads, length, head_dim]."""

    layers: list[tuple[Tensor, Tensor]]
    length: int


def row_prompt_kv(layers: list[tuple[Tensor, Tensor]], row: int, spans: list[tuple[int, int]]) -> PromptKV:
    """A copy of row ``row``'s prompt keys/values (``layers``: each [B, kv_heads, T, head_dim]), the columns of
    ``spans`` in order."""
    layers = [(torch.cat([keys[row:row + 1, :, a:b] for a, b in spans], dim=2),
               torch.cat([values[row:row + 1, :, a:b] for a, b in spans], dim=2)) for keys, values in layers]
    return PromptKV(layers, sum(b - a for a, b in spans))


def prompt_spans(prompt_lengths: list[int], prefix_lengths: list[int], width: int) -> list[list[tuple[int, int]]]:
    """Each prompt's column spans in a generation batch of ``width`` columns: one in a left-padded batch, else the
    kept prefix's in the prefix block and the rest's in the rest block (``batch_with_prefixes``)."""
    t_len = max(prefix_lengths)
    spans = []
    for n_prompt, n_prefix in zip(prompt_lengths, prefix_lengths):
        rest = [(width - (n_prompt - n_prefix), width)]
        spans.append(([(t_len - n_prefix, t_len)] if n_prefix else []) + rest)
    return spans


def batch_with_prefixes(prompt_ids: list[list[int]], prefixes: list[PromptKV | None], pad_token_id: int,
                        config) -> tuple[dict[str, Tensor], DynamicCache]:
    """``({"input_ids", "attention_mask"} [B, T + R], cache of length T)`` for prompts whose first
    ``prefixes[i].length`` ids are cached: T the longest prefix (all padding for rows without one), R the longest rest.
    Raises ValueError: lengths differ, or a prefix covers its whole prompt (its last token must be fed)."""
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


def slice_prompt_kv(kv: PromptKV, length: int) -> PromptKV:
    """The first ``length`` positions of ``kv`` (views)."""
    return PromptKV([(k[:, :, :length], v[:, :, :length]) for k, v in kv.layers], length)


def shared_runs(prompt_ids: list[list[int]], min_length: int) -> list[tuple[list[int], int]]:
    """Runs of rows whose prompts share at least ``min_length`` ids, ``[(rows, prefix length)]``, each row in at most
    one run, a prefix leaving each prompt's last id. The rows, in token order, are cut where the ids saved ((k - 1)·L
    for k rows sharing L) are most (dynamic programming): a task's episodes form one run, not one with every other task
    over the system prompt alone."""
    order = sorted(range(len(prompt_ids)), key=lambda i: prompt_ids[i])
    m = len(order)
    # lcp[j]: what rows j and j + 1 (in order) share, leaving each one's last id
    lcp = [min(common_prefix(prompt_ids[a], prompt_ids[b]), len(prompt_ids[a]) - 1, len(prompt_ids[b]) - 1)
           for a, b in zip(order, order[1:])]
    best = [0] * (m + 1)  # best[j]: ids saved by the best cut of the first j rows
    cut: list[tuple[int, int]] = [(0, 0)] * (m + 1)  # (start of the last run, its prefix length)
    for j in range(1, m + 1):
        best[j], cut[j] = best[j - 1], (j - 1, 0)
        shared = None
        for i in range(j - 2, -1, -1):  # the run order[i:j]
            shared = lcp[i] if shared is None else min(shared, lcp[i])
            if shared < min_length:
                break
            if best[i] + (j - i - 1) * shared > best[j]:
                best[j], cut[j] = best[i] + (j - i - 1) * shared, (i, shared)
    runs, j = [], m
    while j > 0:
        i, length = cut[j]
        if length:
            runs.append(([order[k] for k in range(i, j)], length))
        j = i
    return runs[::-1]


class SharedPrefixes:
    """Keys/values of the prompt prefixes that rows of a generation share, computed once and reused while the weights
    stay the same (one per rollout): ``for_batch`` gives each ``shared_runs`` run one ``PromptKV``, from the last call's
    where they cover it; a row in no run reuses the longest kept prefix it starts with. Only the last call's prefixes
    are kept. ``prompt_tokens`` / ``computed_tokens``: prompt ids seen / computed."""

    def __init__(self, min_length: int = 16):
        self.min_length = int(min_length)
        self.kept: list[tuple[list[int], PromptKV]] = []
        self.prompt_tokens = 0
        self.computed_tokens = 0

    def _longest_kept(self, ids: list[int], limit: int) -> PromptKV | None:
        """The longest kept prefix of ``ids``, at most ``limit`` ids (None under ``min_length``)."""
        best = None
        for kept_ids, kv in self.kept:
            n = min(common_prefix(kept_ids, ids), limit)
            if n >= self.min_length and (best is None or n > best.length):
                best = slice_prompt_kv(kv, n)
        return best

    def for_batch(self, compute, prompt_ids: list[list[int]]) -> list[PromptKV | None] | None:
        """One ``PromptKV`` (or None) per row, None when no row has one. ``compute(ids, past)`` returns the ``PromptKV``
        of ``ids`` continuing ``past`` (of their first ``past.length`` ids, or None)."""
        out: list[PromptKV | None] = [None] * len(prompt_ids)
        kept: list[tuple[list[int], PromptKV]] = []
        for rows, n in shared_runs(prompt_ids, self.min_length):
            ids = prompt_ids[rows[0]][:n]
            kv = self._longest_kept(ids, n)
            if kv is None or kv.length < n:
                self.computed_tokens += n - (0 if kv is None else kv.length)
                kv = compute(ids, kv)
            kept.append((ids, kv))
            for r in rows:
                out[r] = kv
        for r, ids in enumerate(prompt_ids):
            if out[r] is None:
                out[r] = self._longest_kept(ids, len(ids) - 1)
        self.prompt_tokens += sum(len(p) for p in prompt_ids)
        self.computed_tokens += sum(len(p) - (0 if kv is None else kv.length) for p, kv in zip(prompt_ids, out))
        self.kept = kept or self.kept
        return out if any(kv is not None for kv in out) else None
