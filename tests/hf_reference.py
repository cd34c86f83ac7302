"""The generation path the rollout engine replaced, kept as the reference its exactness tests compare with:
``transformers``' ``generate`` with two logits processors, one recording the sampled tokens' log-probs under
softmax(logits / T), one drawing each row's token from its own seeded stream (then picked greedily)."""
from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from src.models.batch_layout import pack_batch
from src.models.prompt_cache import batch_with_prefixes
from src.models.sampling import RowStreams


class _Recorder(LogitsProcessor):
    def __init__(self, temperature: float):
        self.temperature, self.previous, self.steps = temperature, None, []

    def __call__(self, input_ids, scores):
        self._gather(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _gather(self, tokens):
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
            self.previous = None

    def finish(self, sequences):
        if sequences.shape[1]:
            self._gather(sequences[:, -1])
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(sequences.shape)


class _SeededRows(LogitsProcessor):
    """Every row's own stream, drawn for every row at every step (finished rows included), as the replaced path did."""

    def __init__(self, seeds: list[int], temperature: float):
        self.streams, self.step = RowStreams(seeds, temperature, "cpu", counter=False), 0

    def __call__(self, input_ids, scores):
        tokens = self.streams.draw(scores, torch.arange(scores.shape[0]), self.step)
        self.step += 1
        return torch.full_like(scores, -torch.inf).scatter_(-1, tokens[:, None], 0.0)


@torch.no_grad()
def hf_generate(policy, prompt_ids, max_new_tokens: int, temperature: float = 1.0, do_sample: bool = True,
                seeds=None, prefix_kv=None) -> tuple[list[list[int]], list[list[float]]]:
    """(response ids cut after the first EOS, their log-probs) of the replaced path."""
    recorder = _Recorder(temperature)
    seeded = do_sample and seeds is not None
    processors = [recorder] + ([_SeededRows(seeds, temperature)] if seeded else [])
    pad = policy.tokenizer.pad_token_id
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample and not seeded,
                              temperature=temperature if do_sample and not seeded else None, top_k=0, top_p=1.0,
                              eos_token_id=list(policy.eos_token_ids), pad_token_id=pad, return_dict_in_generate=True)
    extra = {}
    if prefix_kv is not None:
        batch, extra["cache"] = batch_with_prefixes(prompt_ids, prefix_kv, pad, policy.model.config)
    else:
        batch = pack_batch(prompt_ids, [[] for _ in prompt_ids], pad)
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    saved, policy.model.generation_config = policy.model.generation_config, GenerationConfig()
    try:
        out = policy.model.eval().generate(**batch, generation_config=config,
                                           logits_processor=LogitsProcessorList(processors), **extra)
    finally:
        policy.model.generation_config = saved
    sequences = out.sequences[:, batch["input_ids"].shape[1]:]
    lps = recorder.finish(sequences)
    eos = torch.tensor(policy.eos_token_ids)
    ids, log_probs = [], []
    for i in range(sequences.shape[0]):
        hits = torch.isin(sequences[i], eos).nonzero()
        n = int(hits[0]) + 1 if len(hits) else sequences.shape[1]
        ids.append(sequences[i, :n].tolist())
        log_probs.append(lps[i, :n].tolist())
    return ids, log_probs
