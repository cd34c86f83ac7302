"""The rollout engine behind ``Policy.generate``: how a batch of prompts becomes replies (``RolloutEngine``).

Decoding (gpt-fast's shape) is one prefill, then a loop over the model's own forward drawing one token per row
(``sampling.Sampler``). A row ends at its first EOS (kept: the policy learns to stop); with seeded streams it then
leaves the batch; without, every row stays: torch's generator draws one batch-shaped sample per step, and a smaller
batch would change the other rows' draws. Each phase has its precision (``model.policy.rollout_precision``): a
prefill is compute-bound (bf16 autocast wins on CPUs with AVX512-BF16 or AMX), a decoding step bound by the weights'
bytes (bf16 steps run a bf16 copy, ``InferenceCopy``: autocast would cast frozen weights again every step)."""
from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from src.models.batch_layout import pack_batch
from src.models.prompt_cache import PromptKV, SharedPrefixes, batch_with_prefixes, prompt_spans
from src.models.sampling import Sampler
from src.models.static_decode import causal_lm, decode_static
from src.utils.distributed import all_reduce, is_distributed
from src.utils.startup_checks import BF16_DECODE, on_cuda, rollout_precision_under_fsdp, sharded

log = logging.getLogger(__name__)

ROLLOUT_PRECISIONS = ("auto", "trainer", "fp32", "bf16-prefill", "bf16-decode", "bf16")
MIN_BF16_SPEEDUP = 1.25  # as trainer.precision=auto (src/utils/precision_choice.py)
_CHOSEN: dict[str, tuple[str, str]] = {}  # device type -> (auto's choice, its reason): this process's, made once


@dataclass(frozen=True)
class EngineSettings:
    """``model.policy.rollout_precision`` and ``static`` (``model.policy.cuda_graphs``: ``"graphs"``, steps over
    preallocated keys/values, each a CUDA graph on a GPU, eager elsewhere; ``"eager"``; None: the dynamic cache)."""

    rollout_precision: str = "auto"
    static: str | None = None


@dataclass
class Decoded:
    """``tokens`` / ``log_probs``: ``[B, T]`` (long, float32 nats), row i's response (EOS included) in its first
    ``lengths[i]`` columns, ``truncated[i]`` without EOS; ``kv`` (``keep_prompt_kv``): the prompts' keys/values after
    the prefill, each layer's ``[B, kv_heads, width, head_dim]``, and each prompt's column spans in them."""

    tokens: Tensor
    log_probs: Tensor
    lengths: list[int]
    truncated: list[bool]
    kv: tuple[list[tuple[Tensor, Tensor]], list[list[tuple[int, int]]]] | None = None


class Replies:
    """The replies being written, ``[B, max_new_tokens]`` on the device: tokens (pad after the end), each drawn token's
    log-prob, lengths, and which rows have ended."""

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


class RolloutEngine:
    """One policy's engine: its settings, its decoding steps' bf16 copy and the precision its ranks agreed on.
    Raises ValueError for ``settings.static`` with a model the static step cannot run."""

    def __init__(self, settings: EngineSettings = EngineSettings(), model: nn.Module | None = None):
        if settings.static and model is not None:
            causal_lm(model)  # refuses a model the static step cannot run when built, not at the first rollout
        self.settings = settings
        self.copy = InferenceCopy()  # not a submodule of the policy: never in a state dict or an optimizer
        self.agreed: str | None = None  # rank 0's rollout precision, once ``agree`` ran under torch.distributed

    def precision(self, device_type: str, synced: bool = False) -> str:
        """The agreed rollout precision, else the setting with ``auto`` resolved; under FSDP (``synced``) after
        ``rollout_precision_under_fsdp``. Raises ValueError: an unknown value; bf16 decoding steps asked for
        explicitly under FSDP."""
        requested = self.settings.rollout_precision
        value = self.agreed or rollout_precision(requested, device_type)
        return rollout_precision_under_fsdp(value, "FSDP", chosen=requested == "auto") if synced else value

    def agree(self) -> None:
        """Every rank takes rank 0's rollout precision: each rank re-ran the entry point and its own ``auto``
        probe, and probes can disagree. A collective, so called from ``EMPO2Module.configure_model``, which every
        rank passes (a reflection may reach the first ``generate`` on one rank only)."""
        if not is_distributed():
            return
        import torch.distributed as dist

        mine = self.precision("cuda" if dist.get_backend() == "nccl" else "cpu")
        chosen = [mine]
        dist.broadcast_object_list(chosen, src=0)
        self.agreed = chosen[0]
        if chosen[0] != mine:
            log.info("Rollout precision: %s (rank 0's; this rank had %s)", chosen[0], mine)

    @torch.no_grad()
    def generate(self, model, prompt_ids: list[list[int]], sampler: Sampler, replies: Replies, *,
                 prefix_kv: list[PromptKV | None] | None = None, shared: SharedPrefixes | None = None,
                 keep_prompt_kv: bool = False, synced: bool = False) -> Decoded:
        """Replies to ``prompt_ids`` into ``replies`` (arguments: ``Policy.generate``), in eval mode, kept or shared
        prefixes fed as a cache."""
        was_training = model.training
        model.eval()
        try:
            if shared is not None and prefix_kv is None and not synced:
                prefix_kv = shared.for_batch(lambda ids, past: _prefix_kv(model, ids, past), prompt_ids)
            if prefix_kv is not None and any(p is not None for p in prefix_kv):
                batch, cache = batch_with_prefixes(prompt_ids, prefix_kv, replies.pad, model.config)
            else:
                prefix_kv, cache = None, None
                batch = pack_batch(prompt_ids, [[] for _ in prompt_ids], replies.pad)
            device = replies.tokens.device
            out = self.decode(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), cache, replies,
                              sampler, keep_prompt_kv, synced)
        finally:
            model.train(was_training)
        if keep_prompt_kv:
            kept = [0 if p is None else p.length for p in (prefix_kv or [None] * len(prompt_ids))]
            out.kv = (out.kv[0], prompt_spans([len(p) for p in prompt_ids], kept, batch["input_ids"].shape[1]))
        return out

    def decode(self, model, input_ids: Tensor, attention_mask: Tensor, cache: DynamicCache | None, replies: Replies,
               sampler: Sampler, keep_prompt_kv: bool = False, synced: bool = False) -> Decoded:
        """Prefill ``input_ids`` ``[B, W]`` (left-padded prompts, or ``[prefix block | rest]`` with ``cache``
        holding the prefix block: ``batch_with_prefixes``), then decode until ``replies`` is full or every row ended.
        ``synced`` (FSDP): every rank steps, rows kept, until no rank has a running row, on the dynamic cache (a
        captured step cannot gather sharded weights)."""
        device, value = input_ids.device.type, self.precision(input_ids.device.type, synced)
        step_model = self.copy.refreshed(model) if value in BF16_DECODE else model
        # no cast cache in a bf16 prefill: inside the Trainer's autocast it would keep a second bf16 copy of the
        # trainable weights for the whole rollout, and a prefill casts each weight once per call anyway
        prefill = contextlib.nullcontext() if value == "trainer" else torch.autocast(
            device, dtype=torch.bfloat16, enabled=value in ("bf16", "bf16-prefill"), cache_enabled=False)
        with prefill:
            out = _forward(model, input_ids[:, cache.get_seq_length():] if cache is not None else input_ids,
                           attention_mask, cache)
        cache, logits = out.cache, out.logits[:, -1].float()
        if value != "trainer":  # the steps' keys/values in the dtype of the weights they run
            dtype = next(step_model.parameters()).dtype
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
        kept = [(layer.keys, layer.values) for layer in cache.layers] if keep_prompt_kv else None
        static = None if synced else self.settings.static
        # the steps' weights carry their dtype: autocast off, also inside the Trainer's
        with contextlib.nullcontext() if value == "trainer" else torch.autocast(device, enabled=False):
            if static:
                layers = [(layer.keys, layer.values) for layer in cache.layers]
                del out, cache  # only ``layers`` (and ``kept``) hold the prefill's keys/values now
                decode_static(step_model, layers, logits, attention_mask, replies, sampler,
                              replies.tokens.shape[1], synced, graphs=static == "graphs")
            else:
                _decode_dynamic(step_model, cache, logits, attention_mask, replies, sampler, synced)
        return Decoded(replies.tokens.cpu(), replies.log_probs.cpu(), replies.lengths.tolist(),
                       (~replies.finished).tolist(), None if kept is None else (kept, []))


def _forward(model, input_ids: Tensor, mask: Tensor, cache, logits_to_keep: int = 1):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]  # padding never shifts a position
    return model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                 logits_to_keep=logits_to_keep)


def _prefix_kv(model, ids: list[int], past: PromptKV | None = None) -> PromptKV:
    """Keys/values of the prefix ``ids`` (no grad), continuing ``past`` (its first ``past.length`` ids) when given."""
    start = 0 if past is None else past.length
    cache = None if past is None else DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in past.layers],
                                                   config=model.config)
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids[start:]], device=device), cache=cache, use_cache=True, logits_to_keep=1)
    return PromptKV([(layer.keys, layer.values) for layer in out.cache.layers], len(ids))


def _decode_dynamic(model, cache, logits: Tensor, mask: Tensor, replies: Replies, sampler: Sampler,
                    synced: bool) -> None:
    """The decoding loop over the model's forward and its growing cache; ended rows leave the batch only with seeded
    streams and not ``synced`` (module docstring)."""
    rows = torch.arange(mask.shape[0], device=mask.device)
    drop = sampler.streams is not None and not synced
    max_new_tokens = replies.tokens.shape[1]
    for step in range(max_new_tokens):
        chosen = replies.add(step, rows, *sampler.pick(logits, rows, step))
        if step + 1 == max_new_tokens or not replies.running(synced):
            break
        if drop and bool(replies.finished[rows].any()):
            keep = (~replies.finished[rows]).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, mask, chosen = rows[keep], mask[keep], chosen[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = _forward(model, chosen[:, None], mask, cache).logits[:, -1].float()


def probe_phases(hidden: int = 576, ffn: int = 1536, prefill_rows: int = 128, decode_rows: int = 8,
                 decode_matrices: int = 48, max_seconds: float = 0.2) -> dict[str, float]:
    """bf16's speed-up over fp32 (> 1: bf16 faster) on this CPU of each phase's products as it runs them: a prefill,
    ``[prefill_rows, hidden] @ [hidden, ffn]`` under bf16 autocast; a decoding step, ``[decode_rows, hidden]`` through
    ``decode_matrices`` bf16 weights (170 MB in fp32 by default: a step streams its weights from memory, which one small
    cached matrix does not show). ``{"prefill", "decode"}``, best of up to 6 repetitions after a warm-up; a dtype stops
    after ``max_seconds`` (an emulated bf16 product on an AVX2 CPU is ~50x slower)."""
    generator = torch.Generator().manual_seed(0)
    out = {}
    for phase, rows, count in (("prefill", prefill_rows, 1), ("decode", decode_rows, decode_matrices)):
        weight = torch.randn(ffn, hidden, generator=generator)
        weights = [weight] + [weight.clone() for _ in range(count - 1)]  # distinct memory, as a model's layers
        x = torch.randn(rows, hidden, generator=generator)
        best = {}
        for bf16 in (False, True):
            copied = bf16 and phase == "decode"
            inputs, ws = (x.bfloat16(), [w.bfloat16() for w in weights]) if copied else (x, weights)
            times, start = [], time.perf_counter()
            for _ in range(7):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and not copied):
                    tic = time.perf_counter()
                    for w in ws:
                        torch.nn.functional.linear(inputs, w)
                    times.append(time.perf_counter() - tic)
                if time.perf_counter() - start > max_seconds:
                    break
            best[bf16] = min(times[1:] or times)  # the first call warms up
        out[phase] = best[False] / best[True]
    return out


def decide_rollout_precision(device_type: str, probe: dict[str, float] | None = None) -> tuple[str, str]:
    """(``auto``'s precision, a one-line reason): ``trainer`` on a GPU; on a CPU bf16 in each phase that ``probe``
    shows at least ``MIN_BF16_SPEEDUP`` times faster. Raises ValueError for a CPU without its probe."""
    if device_type != "cpu":
        return "trainer", "a GPU: the Trainer's precision in both phases"
    if probe is None:
        raise ValueError("decide_rollout_precision('cpu') needs probe_phases()")
    fast = {phase: probe[phase] >= MIN_BF16_SPEEDUP for phase in ("prefill", "decode")}
    choice = {(False, False): "fp32", (True, False): "bf16-prefill", (False, True): "bf16-decode",
              (True, True): "bf16"}[fast["prefill"], fast["decode"]]
    return choice, (f"bf16 autocast {probe['prefill']:.2f}x fp32's speed in a prefill product, bf16 weights "
                    f"{probe['decode']:.2f}x in a decoding one, on this CPU")


def rollout_precision(value: str, device_type: str) -> str:
    """``value`` with ``auto`` replaced by this process's choice for ``device_type``, made and logged once.
    Raises ValueError for a value not in ``ROLLOUT_PRECISIONS``."""
    if value not in ROLLOUT_PRECISIONS:
        raise ValueError(f"model.policy.rollout_precision={value!r}: expected one of {ROLLOUT_PRECISIONS}")
    if value != "auto":
        return value
    if device_type not in _CHOSEN:
        _CHOSEN[device_type] = decide_rollout_precision(device_type,
                                                        probe_phases() if device_type == "cpu" else None)
        log.info("Rollout precision: %s (%s; model.policy.rollout_precision=auto, override with e.g. "
                 "model.policy.rollout_precision=fp32)", *_CHOSEN[device_type])
    return _CHOSEN[device_type][0]


def resolve_rollout_precision(cfg) -> str | None:
    """Write this machine's choice for ``model.policy.rollout_precision=auto`` into ``cfg`` (under FSDP after
    ``rollout_precision_under_fsdp``), so the logged config says what ran; returns it (None without a policy).
    Raises ValueError for an unknown value."""
    from omegaconf import open_dict

    policy = (cfg.get("model") or {}).get("policy")
    if policy is None:
        return None
    trainer = cfg.get("trainer") or {}
    requested = str(policy["rollout_precision"])
    value = rollout_precision(requested, "cuda" if on_cuda(str(trainer.get("accelerator", "auto")).lower()) else "cpu")
    fsdp = sharded(trainer)
    if requested == "auto" and fsdp and value != rollout_precision_under_fsdp(value, fsdp, chosen=True):
        value = rollout_precision_under_fsdp(value, fsdp, chosen=True)
        log.info("Rollout precision under FSDP: %s (its sharded weights cannot be copied for bf16 decoding steps)",
                 value)
    with open_dict(policy):
        policy.rollout_precision = value
    return value


class InferenceCopy:
    """A copy of one model in ``dtype`` for bf16 decoding steps, whose time is the weights' bytes (docs/performance.md).
    Only parameters of another dtype are copied (a bf16 LoRA base is shared); buffers are kept (a bf16 rotary
    ``inv_freq`` would shift late positions' phase). Refreshed from the live weights at every ``generate`` call (a
    fused optimizer and ``.data`` writes bump no version counter); rebuilt when the model, a parameter object, shape,
    device, dtype or a PEFT layer's adapter state changes."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self.source: nn.Module | None = None
        self.model: nn.Module | None = None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the copy's tensor, the live parameter it mirrors)
        self.layout: list[tuple] = []

    def __deepcopy__(self, memo) -> "InferenceCopy":
        return InferenceCopy(self.dtype)  # a copied policy builds its own copy of its own weights

    def refreshed(self, model: nn.Module) -> nn.Module:
        """``model`` itself where every parameter is ``dtype``, else the frozen eval-mode copy, weights refreshed."""
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
