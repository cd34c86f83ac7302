"""The ``[left-padded prompt | right-padded response]`` layout of every batched forward pass of the policy: every
prompt ends at column ``P``, so the logits predicting response token ``j`` are at column ``P - 1 + j``."""
from __future__ import annotations

import torch
from torch import Tensor


def pack_batch(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int) -> dict[str, Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids`` [B, P + R] (positions follow the mask) and ``response_mask``
    [B, R], P and R the longest prompt and response.

    Raises:
        ValueError: the two lists differ in length, or a prompt is empty."""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("an empty prompt was given; every prompt needs at least one token")
    batch = len(prompt_ids)
    p_len = max(len(p) for p in prompt_ids)
    r_len = max((len(r) for r in response_ids), default=0)
    input_ids = torch.full((batch, p_len + r_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, p_len + r_len), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, p_len - len(p):p_len] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, p_len - len(p):p_len + len(r)] = 1
        if r:
            input_ids[i, p_len:p_len + len(r)] = torch.tensor(r, dtype=torch.long)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": attention_mask[:, p_len:].clone(),
    }
