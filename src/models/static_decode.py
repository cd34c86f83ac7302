"""Decoding steps over preallocated keys/values (gpt-fast's shape), each captured in a CUDA graph on a GPU, where
kernel launches, not bytes, bound a 7B decoding step (docs/performance.md). A step writes one column in place
(``StaticKV``) and runs the model's own layers on fixed shapes. Running rows are repacked into the smallest
power-of-two bucket that holds them (one capture each); a row's draw depends only on its seed and step, never on
its slot. Graphs are captured per ``generate`` call, so they read that moment's weights; on a CPU the loop runs
eagerly. Tokens and log-probs equal the dynamic loop's (fp32, tests/test_static_decode.py)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from src.models.sampling import Sampler

STATIC_MODEL_TYPES = ("llama", "qwen2")  # decoders whose forward is embedding, layers, norm, head and no more


class StaticKV:
    """Each layer's keys and values, ``[B, kv_heads, L, head_dim]``, written in place at column ``slot`` (a ``[1]``
    long tensor, so a captured graph reads its current value)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], slot: Tensor):
        self.keys, self.values, self.slot = keys, values, slot

    @classmethod
    def from_prefill(cls, layers, length: int, slot: Tensor) -> "StaticKV":
        """Buffers of ``length`` columns, the prefill's keys/values (each ``[B, kv_heads, W, head_dim]``) first."""
        def widen(t: Tensor) -> Tensor:
            out = t.new_zeros(*t.shape[:2], length, t.shape[3])
            out[:, :, :t.shape[2]] = t
            return out
        return cls([widen(k) for k, _ in layers], [widen(v) for _, v in layers], slot)

    def select(self, index: Tensor) -> "StaticKV":
        """A new cache holding rows ``index`` (``[b]`` long; a row may repeat to fill a bucket)."""
        return StaticKV([k.index_select(0, index) for k in self.keys], [v.index_select(0, index) for v in self.values],
                        self.slot)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's ``[B, kv_heads, 1, head_dim]`` keys/values at ``slot``; return the layer's buffers."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slot, key_states.to(keys.dtype))
        values.index_copy_(2, self.slot, value_states.to(values.dtype))
        return keys, values


def causal_lm(model):
    """The causal LM under a PEFT wrapper, checked to be one the step runs exactly: a Llama or Qwen2 decoder (nothing
    computed outside embedding, layers, norm and head) with full attention through SDPA (the step passes SDPA's boolean
    mask; eager attention would add it to the scores). Raises ValueError naming another architecture, attention
    implementation or a sliding window."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(core, "config", None)
    kind = getattr(config, "model_type", type(core).__name__)
    if kind not in STATIC_MODEL_TYPES:
        raise ValueError(f"model.policy.cuda_graphs=true: a {kind} model; the static step runs "
                         f"{list(STATIC_MODEL_TYPES)} decoders only; expected false")
    attention = getattr(config, "_attn_implementation", None)
    if attention != "sdpa":
        raise ValueError(f"model.policy.cuda_graphs=true with attention {attention!r}: the static step passes SDPA's "
                         "boolean mask; expected model.policy.attn_implementation=sdpa (or null)")
    if getattr(config, "sliding_window", None) and set(getattr(config, "layer_types", None) or ["sliding"]) \
            != {"full_attention"}:
        raise ValueError(f"model.policy.cuda_graphs=true: this {kind} model attends through a sliding window of "
                         f"{config.sliding_window} tokens, which the static step does not apply; expected false")
    return core


def forward_step(core, token: Tensor, position: Tensor, valid: Tensor, kv: StaticKV) -> Tensor:
    """Float32 logits ``[B, V]`` of one new token per row: ``token`` / ``position`` ``[B]`` long, ``valid`` ``[B, L]``
    bool (the columns each row attends to; the step's own is set here)."""
    valid.index_fill_(1, kv.slot, True)
    hidden = core.model.embed_tokens(token[:, None])
    position_ids = position[:, None]
    rotary = core.model.rotary_emb(hidden, position_ids)
    mask = valid[:, None, None, :]
    for layer in core.model.layers:
        out = layer(hidden, attention_mask=mask, position_ids=position_ids, cache=kv, position_embeddings=rotary)
        hidden = out[0] if isinstance(out, tuple) else out
    return core.lm_head(core.model.norm(hidden))[:, -1].float()


class _Graph:
    """``fn(*inputs) -> outputs`` captured once in a CUDA graph after a warm-up on a side stream (``first``: its
    outputs); a call copies the inputs in and replays. Autocast's cast cache is off while capturing (torch's advice for
    graphs)."""

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], inputs: list[Tensor]):
        self.inputs = [t.clone() for t in inputs]
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                # the warm-up is this step: capturing executes nothing, so the first replay is the next step
                self.first = fn(*[t.clone() for t in inputs])
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = fn(*self.inputs)
        finally:
            torch.set_autocast_cache_enabled(cache)

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        for mine, given in zip(self.inputs, inputs):
            mine.copy_(given)
        self.graph.replay()
        return self.outputs


@torch.no_grad()
def decode_static(model, layers: list[tuple[Tensor, Tensor]], logits: Tensor, mask: Tensor, replies,
                  sampler: Sampler, max_new_tokens: int, synced: bool, graphs: bool) -> None:
    """``RolloutEngine.decode``'s loop over ``StaticKV``: ``layers`` the prefill's keys/values (each
    ``[B, kv_heads, W, head_dim]``), ``logits`` ``[B, V]`` its last, ``mask`` ``[B, W]``. ``graphs``: a CUDA graph per
    bucket, for seeded streams on CUDA or greedy only (torch's global generator draws a batch-shaped sample per step).
    Raises ValueError from ``causal_lm``."""
    core = causal_lm(model)
    batch, width = mask.shape
    device = mask.device
    streams = sampler.streams
    graphs = graphs and device.type == "cuda" and (streams is None and not sampler.do_sample
                                                   or streams is not None and streams.counter)
    drop = streams is not None and not synced
    slot = torch.full((1,), width, dtype=torch.long, device=device)
    kv = StaticKV.from_prefill(layers, width + max_new_tokens, slot)
    layers.clear()  # the prefill's keys/values now live in ``kv``: free them (unless the caller keeps the prompt's)
    valid = torch.cat([mask.bool(), mask.new_zeros(batch, max_new_tokens, dtype=torch.bool)], dim=1)
    position = mask.long().sum(-1)  # the next token's position: the row's real tokens so far
    rows = torch.arange(batch, device=device)  # the row each batch slot holds (a filler repeats one)
    own = torch.ones(batch, dtype=torch.bool, device=device)  # the slot that records its row (fillers do not)
    step_t = torch.zeros(1, dtype=torch.long, device=device)
    graph = None
    chosen, log_prob = sampler.pick(logits, rows, 0)
    for step in range(max_new_tokens):
        fed = replies.add(step, rows[own], chosen[own], log_prob[own])
        chosen = chosen.masked_scatter(own, fed)
        if step + 1 == max_new_tokens or not replies.running(synced):
            break
        live = own & ~replies.finished[rows]
        if drop and _bucket(int(live.sum()), graphs) < rows.numel():
            keep = live.nonzero().squeeze(1)
            index = torch.cat([keep, keep[:1].expand(_bucket(keep.numel(), graphs) - keep.numel())])
            kv, valid, position, rows, chosen = (kv.select(index), valid[index], position[index], rows[index],
                                                 chosen[index])
            own = torch.arange(index.numel(), device=device) < keep.numel()
            graph = None
        slot.fill_(width + step)
        step_t.fill_(step + 1)

        def one_step(token: Tensor, pos: Tensor, at: Tensor, kv=kv, valid=valid, rows=rows):
            step_logits = forward_step(core, token, pos, valid, kv)
            return sampler.pick(step_logits, rows, at if graphs else int(at))

        if graphs and graph is None:
            graph = _Graph(one_step, [chosen, position, step_t])
            chosen, log_prob = graph.first
        else:
            chosen, log_prob = (graph or one_step)(chosen, position, step_t)
        position = position + 1


def _bucket(live: int, graphs: bool) -> int:
    """The batch size that holds ``live`` rows: exact eagerly; with graphs the next power of two (one capture each)."""
    return live if not graphs or live <= 1 else 1 << (live - 1).bit_length()
