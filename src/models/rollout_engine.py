"""The rollout engine: one prefill and a decoding loop over the model's own forward (gpt-fast's shape), behind
``Policy.generate``, which rollouts, reflections and evaluation all call.

Each step takes the logits of the rows still running, the log-softmax at the temperature (the log-probs the trainer
scores: docs/method.md#rollout-importance-sampling-correction), and one token per row: greedy, torch's global
generator, or each row's own seeded stream (the exponential race ``argmax(logits / T - log E)``, ``E ~ Exp(1)``, which
picks token k with probability ``softmax(logits / T)[k]``). Nothing else shapes sampling: no checkpoint
``generation_config`` is read. A row ends at its first EOS (kept: the policy learns to stop); with seeded streams its
keys/values then leave the batch, so finished rows stop costing. Without seeds every row stays to the end, because
torch's generator draws one batch-shaped sample per step and a smaller batch would change the other rows' draws.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch import Tensor

from src.models.sampling import counter_exponentials, int64
from src.models.static_decode import decode_static
from src.utils.distributed import all_reduce


class RowStreams:
    """Each row's random stream for the exponential race: on a CUDA GPU the counter-based ``counter_exponentials``
    (``counter=True``: a batch is a few element-wise kernels), elsewhere one ``torch.Generator`` per row (on a CPU the
    counter's int64 arithmetic is ~10x slower than torch's sampler; Apple's MPS has no float64). The two draw different
    tokens for the same seeds, each the same in every batch.

    Raises:
        ValueError: a temperature <= 0.
    """

    def __init__(self, seeds: list[int], temperature: float, device: torch.device | str = "cpu",
                 counter: bool | None = None):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature, self.device = temperature, torch.device(device)
        self.counter = self.device.type == "cuda" if counter is None else counter
        if self.counter:
            self.seeds = torch.tensor([int64(int(s)) for s in seeds], dtype=torch.int64, device=device)
        else:
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def draw(self, logits: Tensor, rows: Tensor, step: int) -> Tensor:
        """``[n]`` tokens of the ``n`` rows ``rows`` (their indices among the seeds) at decoding step ``step`` from
        ``logits`` ``[n, V]``."""
        if self.counter:
            log_race = counter_exponentials(self.seeds[rows.to(self.seeds.device)], step, logits.shape[-1]).log_()
        else:
            log_race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            for out, row in zip(log_race, rows.tolist()):
                out.exponential_(generator=self.generators[row])
            log_race.log_()
        return (logits.float() / self.temperature - log_race.float()).argmax(dim=-1)


@dataclass
class Decoded:
    """``tokens`` / ``log_probs``: ``[B, T]`` (long, float32 nats), row i's response in its first ``lengths[i]``
    columns (EOS included); ``truncated[i]``: no EOS within the budget; ``prompt_layers``: the prompts' keys/values after
    the prefill, ``[(keys, values)]`` per layer, each ``[B, kv_heads, width, head_dim]`` (with ``keep_prompt_kv``)."""

    tokens: Tensor
    log_probs: Tensor
    lengths: list[int]
    truncated: list[bool]
    prompt_layers: list[tuple[Tensor, Tensor]] | None


def _forward(model, input_ids: Tensor, mask: Tensor, cache, logits_to_keep: int = 1):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]  # padding never shifts a position
    return model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                 logits_to_keep=logits_to_keep)


class Replies:
    """The replies being written, ``[B, max_new_tokens]`` on the device: tokens (pad after the end), the log-prob of
    each drawn token, lengths, and which rows have ended (at their first EOS, kept)."""

    def __init__(self, batch: int, max_new_tokens: int, eos_token_ids: list[int], pad_token_id: int, device):
        self.tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        self.log_probs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.eos, self.pad = torch.tensor(eos_token_ids, device=device), pad_token_id

    def add(self, step: int, rows: Tensor, chosen: Tensor, log_prob: Tensor) -> Tensor:
        """Append ``chosen`` / ``log_prob`` (``[n]``) to the rows ``rows`` that are still running; return ``chosen``
        with pad for the rows that had already ended (what they are fed next)."""
        live = ~self.finished[rows]
        at = rows[live]
        self.tokens[at, step] = chosen[live]
        self.log_probs[at, step] = log_prob[live]
        self.lengths[at] += 1
        self.finished[at] |= torch.isin(chosen[live], self.eos)
        return torch.where(live, chosen, torch.full_like(chosen, self.pad))

    def running(self, synced: bool) -> bool:
        """Whether another decoding step is needed: a row of this rank is running, or under FSDP one of any rank's."""
        running = float(not bool(self.finished.all()))
        return all_reduce([running], op="max")[0] > 0 if synced else running > 0


def pick(logits: Tensor, temperature: float, do_sample: bool, streams: RowStreams | None, rows: Tensor,
         step: int | Tensor) -> tuple[Tensor, Tensor]:
    """The ``[n]`` tokens drawn from ``logits`` ``[n, V]`` (float32) and their log-probs under
    ``log_softmax(logits / temperature)``: each row's seeded stream, torch's global generator, or greedy."""
    log_softmax = torch.log_softmax(logits / temperature, dim=-1)
    if streams is not None:
        chosen = streams.draw(logits, rows, step)
    elif do_sample:
        chosen = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1).squeeze(1)
    else:
        chosen = logits.argmax(dim=-1)
    return chosen, log_softmax.gather(-1, chosen[:, None]).squeeze(-1)


@torch.no_grad()
def decode(model, input_ids: Tensor, attention_mask: Tensor, cache=None, *, max_new_tokens: int,
           temperature: float, do_sample: bool, eos_token_ids: list[int], pad_token_id: int,
           streams: RowStreams | None = None, keep_prompt_kv: bool = False, synced: bool = False,
           prefill_context: Callable[[], ContextManager] | None = None,
           step_context: Callable[[], ContextManager] | None = None, cache_dtype: torch.dtype | None = None,
           step_model=None, static: str | None = None) -> Decoded:
    """Prefill ``input_ids`` ``[B, W]`` (left-padded prompts, or ``[prefix block | rest]`` with ``cache`` holding the
    prefix block's keys/values: ``batch_with_prefixes``), then decode up to ``max_new_tokens`` tokens per row.

    ``streams``: each row's seeded stream (``do_sample`` only); ``synced`` (FSDP): every rank keeps stepping, rows
    kept, until no rank has a running row. ``prefill_context`` / ``step_context``: context factories for the prefill
    and for each decoding step (their precision: ``src/models/rollout_precision.py``); ``cache_dtype``: the dtype the
    keys/values take after the prefill, for the decoding steps; ``step_model``: the model the decoding steps run
    (the bf16 inference copy of ``model``, ``src/models/inference_copy.py``; default ``model``). ``static``: decode
    over preallocated keys/values (``src/models/static_decode.py``), ``"eager"`` or ``"graphs"`` (each step a CUDA
    graph); None: the dynamic cache.
    """
    with (prefill_context or contextlib.nullcontext)():
        out = _forward(model, input_ids[:, cache.get_seq_length():] if cache is not None else input_ids,
                       attention_mask, cache)
    cache, logits = out.cache, out.logits[:, -1].float()
    if cache_dtype is not None:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to(cache_dtype), layer.values.to(cache_dtype)
    prompt_layers = [(layer.keys, layer.values) for layer in cache.layers] if keep_prompt_kv else None
    replies = Replies(input_ids.shape[0], max_new_tokens, eos_token_ids, pad_token_id, input_ids.device)
    loop = dict(max_new_tokens=max_new_tokens, temperature=temperature, do_sample=do_sample, streams=streams,
                synced=synced, step_context=step_context or contextlib.nullcontext)
    model = model if step_model is None else step_model
    if static:
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        del out, cache  # only ``layers`` (and ``prompt_layers``, when kept) hold the prefill's keys/values now
        decode_static(model, layers, logits, attention_mask, replies, pick, graphs=static == "graphs", **loop)
    else:
        _decode_dynamic(model, cache, logits, attention_mask, replies, **loop)
    return Decoded(replies.tokens.cpu(), replies.log_probs.cpu(), replies.lengths.tolist(),
                   (~replies.finished).tolist(), prompt_layers)


def _decode_dynamic(model, cache, logits: Tensor, mask: Tensor, replies: Replies, *, max_new_tokens: int,
                    temperature: float, do_sample: bool, streams: RowStreams | None, synced: bool,
                    step_context: Callable[[], ContextManager]) -> None:
    """The decoding loop over the model's forward and its growing cache. With seeded streams (and not ``synced``)
    ended rows leave the batch; without, every row stays, because torch's generator draws one batch-shaped sample per
    step and a smaller batch would change the other rows' draws."""
    rows = torch.arange(mask.shape[0], device=mask.device)
    drop = streams is not None and not synced
    for step in range(max_new_tokens):
        chosen = replies.add(step, rows, *pick(logits, temperature, do_sample, streams, rows, step))
        if step + 1 == max_new_tokens or not replies.running(synced):
            break
        if drop and bool(replies.finished[rows].any()):
            keep = (~replies.finished[rows]).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, mask, chosen = rows[keep], mask[keep], chosen[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        with step_context():
            logits = _forward(model, chosen[:, None], mask, cache).logits[:, -1].float()
