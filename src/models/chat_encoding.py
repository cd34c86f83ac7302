"""Chat messages to prompt ids, with control tokens only where the chat template puts them: a tokenizer matches its
added tokens (``<|im_start|>``, ...) anywhere in a string, so a message that spells one (a decoded reply, an
observation, a tip) would forge turns. Prompts that spell none get exactly ``apply_chat_template``'s ids."""
from __future__ import annotations

import logging
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def _added_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[frozenset[int], tuple[str, ...]]:
    """(ids, strings) of the tokenizer's added tokens."""
    added = tokenizer.added_tokens_decoder
    return frozenset(added), tuple(t.content for t in added.values() if t.content)


def _content_spans(text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]] | None:
    """Character spans of each message's content in ``text``, in order; None when a content is not there verbatim."""
    spans, cursor = [], 0
    for message in messages:
        content = str(message.get("content") or "")
        if not content:
            continue
        start = text.find(content, cursor)
        if start < 0:
            return None
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids of ``messages`` by the chat template, contents as plain text (``split_special_tokens``). Needs a fast
    tokenizer (offsets); a template that rewrites contents falls back to the template's ids with a warning."""
    def render(tokenize: bool):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=tokenize, return_dict=False)

    added_ids, added_strings = _added_tokens(tokenizer)
    if not any(s in str(m.get("content") or "") for m in messages for s in added_strings):
        return list(render(True))
    text = render(False)
    spans = _content_spans(text, messages)
    if spans is None or not tokenizer.is_fast:
        log.warning("A message spells a control token (e.g. %s) and this tokenizer's chat template cannot be told "
                    "apart from its contents: the prompt keeps it as a control token", added_strings[:1])
        return list(render(True))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    out: list[int] = []
    for token, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
        if token in added_ids and any(a <= start and end <= b for a, b in spans):
            out.extend(tokenizer.encode(text[start:end], add_special_tokens=False, split_special_tokens=True))
        else:
            out.append(token)
    return out
