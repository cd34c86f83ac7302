"""The policy: a Hugging Face causal LM and its tokenizer behind one small class (docs/usage.md#models). Batches are
laid out as ``[left-padded prompt | right-padded response]`` (``src/models/batch_layout.py``)."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from src.models.batch_layout import pack_batch
from src.models.chat_encoding import encode_chat
from src.models.dropout import zero_config_dropout, zero_module_dropout
from src.models.hub import (adapter_base_model, base_model_setting, load_causal_lm, load_config, load_tokenizer,
                            resolve_name_or_path)
from src.models.log_probs import entropy_from_logits, log_probs_from_logits
from src.models.prefix_tree import build_prefix_tree, common_prefix
from src.models.precision import master_dtype as master_dtype_of  # the build_policy argument has its name
from src.models.policy_config import PolicyConfig
from src.models.prompt_cache import PromptKV, SharedPrefixes, row_prompt_kv
from src.models.rollout_engine import EngineSettings, InferenceCopy, Replies, RolloutEngine
from src.models.sampling import RowStreams, Sampler, dropped_generation_defaults
from src.utils.threads import adapt_threads

log = logging.getLogger(__name__)

MIN_SHARED_PREFIX = 16  # shorter shared prefixes are not worth a second forward call
# A batch computes its common prefix apart only when that saves at least this share of its tokens: the prefix's own
# forward call and the rows' continuing it cost about 15% of the batch's tokens (docs/performance.md).
MIN_SHARED_SAVING = 0.2


@dataclass
class Generation:
    """Sampled responses of one ``Policy.generate`` call, one entry per prompt: ``response_ids[i]`` cut after the first
    EOS (kept: the policy must learn to stop), ``log_probs[i]`` each sampled token's log-prob under logits /
    temperature, ``texts[i]`` decoded without special tokens, ``truncated[i]``: no EOS within ``max_new_tokens``."""

    response_ids: list[list[int]]
    log_probs: list[list[float]]
    texts: list[str]
    truncated: list[bool]
    # (the prompts' keys/values per layer, each prompt's column spans in them) when generate(keep_prompt_kv=True)
    _kv: tuple[list[tuple[Tensor, Tensor]], list[list[tuple[int, int]]]] | None = field(default=None, repr=False)

    def prompt_kv(self, i: int) -> PromptKV:
        """A copy of prompt i's keys/values (needs ``generate(keep_prompt_kv=True)``), to continue it later."""
        if self._kv is None:
            raise ValueError("prompt keys/values were not kept; call generate(..., keep_prompt_kv=True)")
        layers, spans = self._kv
        return row_prompt_kv(layers, i, spans[i])


class Policy(nn.Module):
    """A causal LM policy with its tokenizer (which must have a chat template). ``max_response_tokens``: per step (the
    paper: 32 ScienceWorld, 512 WebShop); ``max_prompt_tokens``: longer prompts keep their last ids (counted in
    ``num_prompts_truncated``); ``temperature``: the default (the paper: rollout 1.0, evaluation 0.4)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 max_response_tokens: int = PolicyConfig.max_response_tokens,
                 max_prompt_tokens: int = PolicyConfig.max_prompt_tokens,
                 temperature: float = PolicyConfig.temperature, engine: EngineSettings = EngineSettings()):
        super().__init__()
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
        self.engine = RolloutEngine(engine, model)  # src/models/rollout_engine.py (not a submodule)
        self.model = model
        self.tokenizer = tokenizer
        self.max_response_tokens = max_response_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.temperature = temperature
        self.num_prompts_truncated = 0
        self.synced = False  # FSDP: every rank joins every forward (sharded weights are gathered inside it)
        self._checked_generation_defaults = False
        eos = tokenizer.eos_token_id
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        ids = set([eos] if isinstance(eos, int) else eos or [])
        ids |= set([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])
        self.eos_token_ids = sorted(ids)

    def _apply(self, fn, *args, **kwargs):
        self.engine.copy = InferenceCopy()  # a move or cast of the policy drops the old inference copy's tensors
        return super()._apply(fn, *args, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode(self, messages: list[dict[str, str]], truncate: bool = True) -> list[int]:
        """Prompt ids of chat ``messages`` (``[{"role", "content"}]``) ending with the assistant header, contents
        encoded as text (``encode_chat``); with ``truncate``, at most the last ``max_prompt_tokens`` ids."""
        ids = encode_chat(self.tokenizer, messages)
        if truncate and len(ids) > self.max_prompt_tokens:
            # a last resort (the prompt builder already bounds the history): the end holds the current turn
            self.num_prompts_truncated += 1
            ids = ids[-self.max_prompt_tokens:]
        return ids

    def encode_next_turn(self, content: str) -> list[int] | None:
        """Ids that close the assistant's turn and add a user turn with ``content`` and the assistant header, to append
        to a prompt plus its response (without the final EOS). ``None`` when the chat template renders a conversation's
        beginning differently once more turns follow (continuing by ids would not match a fresh rendering)."""
        head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        turns = [{"role": "assistant", "content": "A"}, {"role": "user", "content": content}]
        answer = self.tokenizer.encode("A", add_special_tokens=False)
        prompt, full = encode_chat(self.tokenizer, head), encode_chat(self.tokenizer, head + turns)
        if full[:len(prompt)] != prompt or full[len(prompt):len(prompt) + len(answer)] != answer:
            return None
        return full[len(prompt) + len(answer):]

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | None = None, temperature: float | None = None,
                 do_sample: bool = True, keep_prompt_kv: bool = False,
                 prefix_kv: list[PromptKV | None] | None = None, seeds: list[int] | None = None,
                 shared: SharedPrefixes | None = None) -> Generation:
        """Sample one response per prompt in one batched call (``src/models/rollout_engine.py``), from exactly
        ``softmax(logits / temperature)`` over the full vocabulary, the distribution the trainer scores
        (generation_config is ignored). ``do_sample=False``: greedy, log-probs still at ``temperature``. ``seeds`` (one
        per prompt): each row draws from its own stream (``RowStreams``), whatever the other prompts, and an ended row
        leaves the batch.

        Prefix caching (``src/models/prompt_cache.py``): ``keep_prompt_kv`` keeps the prompts' keys/values
        (``Generation.prompt_kv``); ``prefix_kv[i]``, kept under the same weights, stands for prompt i's first
        ``prefix_kv[i].length`` ids; ``shared`` (one per rollout, not under FSDP) computes the prefixes rows share once
        (``SharedPrefixes``). Either gives the same tokens up to float rounding. Raises ValueError for
        ``temperature <= 0``, or not one seed per prompt."""
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        adapt_threads()  # the cores other processes leave free (src/utils/threads.py)
        max_new_tokens = max_new_tokens or self.max_response_tokens
        temperature = self.temperature if temperature is None else temperature
        if not prompt_ids:
            if self.synced:  # this rank has nothing to say, but must join the other ranks' forward passes
                self.generate([[self.tokenizer.eos_token_id]], max_new_tokens, temperature, do_sample)
            return Generation([], [], [], [])
        self._warn_dropped_generation_defaults()
        streams = RowStreams(seeds, temperature, self.device) if do_sample and seeds is not None else None
        replies = Replies(len(prompt_ids), max_new_tokens, self.eos_token_ids, self.tokenizer.pad_token_id, self.device)
        out = self.engine.generate(self.model, prompt_ids, Sampler(temperature, do_sample, streams), replies,
                                   prefix_kv=prefix_kv, shared=shared, keep_prompt_kv=keep_prompt_kv,
                                   synced=self.synced)
        response_ids = [out.tokens[i, :n].tolist() for i, n in enumerate(out.lengths)]
        log_probs = [out.log_probs[i, :n].tolist() for i, n in enumerate(out.lengths)]
        texts = self.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        return Generation(response_ids, log_probs, texts, out.truncated, out.kv)

    def _warn_dropped_generation_defaults(self) -> None:
        if self._checked_generation_defaults:
            return
        self._checked_generation_defaults = True
        dropped = dropped_generation_defaults(getattr(self.model, "generation_config", None))
        if dropped:
            log.warning("Policy sampling ignores the checkpoint's generation_config settings %s: tokens are drawn "
                        "from softmax(logits / T) over the full vocabulary, the distribution whose log-probs the "
                        "trainer uses", ", ".join(f"{k}={v!r}" for k, v in dropped.items()))

    def log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float = 1.0,
                  with_entropy: bool = False, disable_adapters: bool = False,
                  share_prefix: bool = False, tree: bool = False) -> dict[str, Tensor]:
        """Per-token log-probs of ``response_ids`` given ``prompt_ids`` (differentiable unless under no_grad).

        Returns ``log_probs`` [B, R] (float32, 0 where masked), ``response_mask`` [B, R] (float32) and, with
        ``with_entropy``, ``entropy`` [B, R] of the temperature-scaled next-token distribution. ``disable_adapters``:
        the base model of a PEFT policy (the KL reference). ``share_prefix``: the prompts' common prefix is computed
        once, in the forward and the backward pass, when ``prefix_to_share`` says it pays; ``tree``: every token
        the rows share at the same place is computed once, one forward over their prefix tree (``_tree_log_probs``).
        Both give the unshared result up to float rounding. ``tokens_computed``: the tokens the forward computed."""
        adapt_threads()
        if tree:
            return self._tree_log_probs(prompt_ids, response_ids, temperature, with_entropy, disable_adapters)
        n_shared = self.prefix_to_share(prompt_ids, response_ids) if share_prefix else 0
        if n_shared:
            prefix_cache = self._prefix_cache(prompt_ids[0][:n_shared], len(prompt_ids), disable_adapters)
            prompt_ids = [p[n_shared:] for p in prompt_ids]
        batch = pack_batch(prompt_ids, response_ids, self.tokenizer.pad_token_id)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        p_len = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
        r_len = batch["response_mask"].shape[1]
        extra, attention_mask, position_ids = {}, batch["attention_mask"], batch["position_ids"]
        if n_shared:  # the rows continue the shared prefix: its columns are attended to and positions follow it
            extra["cache"] = prefix_cache
            attention_mask = torch.cat([attention_mask.new_ones(len(prompt_ids), n_shared), attention_mask], dim=1)
            position_ids = position_ids + n_shared
        with self.model.disable_adapter() if disable_adapters else contextlib.nullcontext():
            # only the last R + 1 positions predict response tokens: no [B, P + R, V] tensor (GBs for long prompts)
            logits = self.model(input_ids=batch["input_ids"], attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False, logits_to_keep=r_len + 1, **extra).logits
        logits = logits[:, :-1]
        return _response_outputs(logits, batch["input_ids"][:, p_len:], batch["response_mask"].float(), temperature,
                                 with_entropy, n_shared + int(batch["attention_mask"].sum()))

    def _tree_log_probs(self, prompt_ids: list[list[int]], response_ids: list[list[int]], temperature: float,
                        with_entropy: bool, disable_adapters: bool) -> dict[str, Any]:
        """``log_probs`` of the rows computed as one packed prefix tree (``src/models/prefix_tree.py``): a tree-shaped
        attention mask and per-node positions; only the nodes that predict a response token reach the LM head. The
        trunk every row shares (``shared_prefix_length``) runs first as a cache the tree attends to: the tree's
        attention is dense over its nodes, so a long trunk inside it would cost its square."""
        n = self.shared_prefix_length(prompt_ids)
        extra = {"cache": self._prefix_cache(prompt_ids[0][:n], 1, disable_adapters)} if n else {}
        tree = build_prefix_tree([p[n:] for p in prompt_ids], response_ids)
        keep = torch.unique(tree.predict_at[tree.response_mask.bool()])
        keep = keep if len(keep) else torch.zeros(1, dtype=torch.long)
        attend = tree.attention_mask
        if n:  # every node also attends to the trunk
            attend = torch.cat([attend.new_ones(1, 1, tree.num_tokens, n), attend], dim=-1)
        with self.model.disable_adapter() if disable_adapters else contextlib.nullcontext():
            logits = self.model(input_ids=tree.input_ids.to(self.device), attention_mask=attend.to(self.device),
                                position_ids=(tree.position_ids + n).to(self.device), use_cache=False,
                                logits_to_keep=keep.to(self.device), **extra).logits[0]  # [K, V]
        logits = logits[torch.searchsorted(keep, tree.predict_at).clamp(max=len(keep) - 1).to(self.device)]
        return _response_outputs(logits, tree.response_ids.to(self.device), tree.response_mask.to(self.device),
                                 temperature, with_entropy, n + tree.num_tokens)

    def shared_prefix_length(self, prompt_ids: list[list[int]]) -> int:
        """Tokens at the start of every prompt that ``log_probs(share_prefix=True)`` computes once: their common
        prefix, less the shortest prompt's last token (fed to predict the first response token); 0 when under
        ``MIN_SHARED_PREFIX``, for one prompt, or with gradient checkpointing on (it drops a passed cache)."""
        if len(prompt_ids) < 2 or getattr(self.model, "is_activation_checkpointing", False):
            return 0
        n = min([min(len(p) for p in prompt_ids) - 1] + [common_prefix(prompt_ids[0], p) for p in prompt_ids[1:]])
        return n if n >= MIN_SHARED_PREFIX else 0

    def prefix_to_share(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> int:
        """``shared_prefix_length``, or 0 when the (rows − 1) × prefix tokens it saves are under ``MIN_SHARED_SAVING``
        of the batch's prompt + response tokens."""
        n = self.shared_prefix_length(prompt_ids)
        total = sum(len(p) for p in prompt_ids) + sum(len(r) for r in response_ids)
        return n if n and (len(prompt_ids) - 1) * n >= MIN_SHARED_SAVING * total else 0

    def _prefix_cache(self, prefix: list[int], batch_size: int, disable_adapters: bool) -> DynamicCache:
        """Keys/values of ``prefix`` computed once (with autograd), viewed as ``batch_size`` identical rows."""
        with self.model.disable_adapter() if disable_adapters else contextlib.nullcontext():
            out = self.model(input_ids=torch.tensor([prefix], device=self.device), use_cache=True, logits_to_keep=1)
        layers = [(layer.keys.expand(batch_size, -1, -1, -1), layer.values.expand(batch_size, -1, -1, -1))
                  for layer in out.cache.layers]
        return DynamicCache(ddp_cache_data=layers, config=self.model.config)



def _response_outputs(logits: Tensor, response: Tensor, mask: Tensor, temperature: float, with_entropy: bool,
                      computed: int) -> dict[str, Any]:
    """``Policy.log_probs``' result from the logits predicting each response token (``[B, R, V]``)."""
    out = {"log_probs": log_probs_from_logits(logits, response, temperature=temperature) * mask,
           "response_mask": mask, "tokens_computed": computed}
    if with_entropy:
        out["entropy"] = entropy_from_logits(logits, temperature=temperature) * mask
    return out

def reference_is_a_copy(policy: dict[str, Any]) -> bool:
    """Whether the KL reference of a policy built from ``policy`` is a frozen copy of the model as loaded rather than
    the model with its LoRA adapters off: without LoRA, and when LoRA continues an adapter loaded from ``name_or_path``
    (adapters off would give the raw base model)."""
    settings = PolicyConfig.from_dict(policy)
    if not (settings.lora and settings.lora.enabled):
        return True
    path = resolve_name_or_path(settings.name_or_path, settings.cache_dir)
    return adapter_base_model(path) is not None


def build_policy(trainable: bool = True, **settings: Any) -> Policy:
    """Load tokenizer + causal LM (optionally with PEFT LoRA) into a ``Policy``; ``settings``: the ``model.policy`` keys
    (``PolicyConfig``). Trainable parameters are ``master_dtype``, frozen ones ``dtype`` (``src/models/precision.py``);
    every dropout probability is set to 0 with a warning (``src/models/dropout.py``). ``name_or_path`` may be a PEFT
    adapter directory: with LoRA on that adapter is trained (its own r, alpha, targets), with LoRA off it is merged.
    Raises ValueError for a bad setting or dtype name, or ``cuda_graphs`` with a model the static step cannot run;
    OSError for a model (or an adapter's base) neither local nor in the Hugging Face cache."""
    s = PolicyConfig.from_dict(settings)
    name_or_path, cache_dir, dtype, master_dtype, lora = s.name_or_path, s.cache_dir, s.dtype, s.master_dtype, s.lora
    path = resolve_name_or_path(name_or_path, cache_dir)
    adapter, setting = None, "model.policy.name_or_path"
    base = adapter_base_model(path)
    if base is not None:
        adapter, path, setting = path, resolve_name_or_path(base, cache_dir), base_model_setting(path)
    has_tokenizer = adapter is not None and (Path(adapter) / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(adapter) if has_tokenizer else load_tokenizer(path, setting)
    lora_on = bool(lora and lora.enabled)
    master = master_dtype_of(master_dtype) if trainable else None
    config = load_config(path, setting)
    zeroed = [f"{k}={v}" for k, v in zero_config_dropout(config).items()]
    model = load_causal_lm(path, dtype=master_dtype if trainable and not lora_on else dtype,
                           attn_implementation=s.attn_implementation, config=config, setting=setting)
    if s.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_on and s.gradient_checkpointing:
        model.enable_input_require_grads()
    if adapter is not None:
        from peft import PeftModel

        # get_peft_model on top would add a fresh adapter of the same name and train the raw base (TRL #1340)
        model = PeftModel.from_pretrained(model, adapter, is_trainable=lora_on and trainable)
        if lora_on:
            loaded = model.peft_config["default"]
            targets = loaded.target_modules
            log.info("Continuing the LoRA adapter %s (r=%s, alpha=%s, target modules: %s) on %s; "
                     "model.policy.lora.r/alpha/target_modules are not used", adapter, loaded.r, loaded.lora_alpha,
                     targets if isinstance(targets, str) else f"{len(targets)} modules", path)
        else:
            model = model.merge_and_unload().requires_grad_(True)  # PEFT froze the base; trainable decides below
            log.info("Merged the LoRA adapter %s into its base model %s; the merged model is the policy", adapter,
                     path)
    elif lora_on:
        from peft import LoraConfig, get_peft_model

        if float(lora.dropout):
            zeroed.append(f"model.policy.lora.dropout={lora.dropout}")
        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                                 target_modules=lora.target_modules, task_type="CAUSAL_LM"))
    zeroed += [f"{n} dropout module(s)/attribute(s) with p={p}" for p, n in zero_module_dropout(model).items()]
    if zeroed:
        log.warning("The policy %s is built without dropout (π_old is scored in eval mode and the update runs in "
                    "train mode: any dropout would make the first PPO ratio differ from 1); set to 0: %s",
                    name_or_path, ", ".join(zeroed))
    if trainable:
        for p in model.parameters():
            if p.requires_grad and p.dtype != master:
                p.data = p.data.to(master)
    else:
        model.requires_grad_(False)
    return Policy(model, tokenizer, max_response_tokens=s.max_response_tokens, max_prompt_tokens=s.max_prompt_tokens,
                  temperature=s.temperature,
                  engine=EngineSettings(s.rollout_precision, "graphs" if s.cuda_graphs else None))
