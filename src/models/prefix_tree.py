"""Rows of prompt + response tokens as one prefix tree, packed into a single sequence (docs/design.md, "Every shared
token computed once"): a token that several rows share at the same place (the system prompt, the task, the history,
a whole prompt scored with several responses) is one node, computed once in the forward and the backward pass.

Nodes are numbered in the order they are first met, so a node's ancestors come before it. Node ``i`` sits at
position ``depth(i)`` (its token's index in every row that holds it) and attends to its ancestors and itself, which
is what it attends to in each of those rows alone: its keys, values and logits are those of the unshared rows, up to
float rounding, and each row's loss gradient reaches the shared nodes once per row, as it would unshared.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PrefixTree:
    """A packed prefix tree of ``B`` rows; ``T`` nodes, ``R`` the longest response.

    Attributes:
        input_ids: [1, T] long, each node's token.
        position_ids: [1, T] long, each node's depth (its index within any row holding it).
        attention_mask: [1, 1, T, T] bool, True where node i attends to node j (j an ancestor of i, or i).
        predict_at: [B, R] long, the node whose logits predict response token r of row b (0 where padding).
        response_ids: [B, R] long, the responses, padded with 0.
        response_mask: [B, R] float32, 1 on response tokens.
        nominal_tokens: Σ over rows of prompt + response tokens (what computing the rows alone costs).
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    predict_at: Tensor
    response_ids: Tensor
    response_mask: Tensor
    nominal_tokens: int

    @property
    def num_tokens(self) -> int:
        """T, the tokens the tree computes."""
        return int(self.input_ids.shape[1])


def tree_size(rows: list[list[int]]) -> int:
    """The nodes of the prefix tree of ``rows`` (token sequences): Σ len − the tokens each row shares with the rows
    before it. Sorted rows need only their neighbour's common prefix."""
    ordered = sorted(rows)
    shared = sum(common_prefix(a, b) for a, b in zip(ordered, ordered[1:]))
    return sum(len(r) for r in rows) - shared


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)


def build_prefix_tree(prompt_ids: list[list[int]], response_ids: list[list[int]]) -> PrefixTree:
    """The prefix tree of rows ``prompt + response``.

    Raises:
        ValueError: the lists differ in length, or a prompt is empty (its first response token needs a node
            before it).
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("an empty prompt was given; every prompt needs at least one token")
    tokens: list[int] = []
    depth: list[int] = []
    children: list[dict[int, int]] = [{}]  # children[0]: the roots; children[i + 1]: node i's
    paths: list[list[int]] = []
    for prompt, response in zip(prompt_ids, response_ids):
        node, path = -1, []
        for d, token in enumerate([*prompt, *response]):
            nxt = children[node + 1].get(token)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(int(token))
                depth.append(d)
                children.append({})
                children[node + 1][token] = nxt
            path.append(nxt)
            node = nxt
        paths.append(path)
    n, rows = len(tokens), len(paths)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for path in paths:  # each node of a path attends to the path up to it
        index = torch.tensor(path)
        mask[index[:, None], index[None, :]] |= torch.ones(len(path), len(path), dtype=torch.bool).tril()
    width = max((len(r) for r in response_ids), default=0)
    predict_at = torch.zeros(rows, width, dtype=torch.long)
    responses = torch.zeros(rows, width, dtype=torch.long)
    response_mask = torch.zeros(rows, width, dtype=torch.float32)
    for b, (prompt, response, path) in enumerate(zip(prompt_ids, response_ids, paths)):
        r = len(response)
        if r:
            # response token k sits at node path[P + k], predicted by the node before it
            predict_at[b, :r] = torch.tensor(path[len(prompt) - 1: len(prompt) - 1 + r])
            responses[b, :r] = torch.tensor(response)
            response_mask[b, :r] = 1.0
    return PrefixTree(input_ids=torch.tensor([tokens]), position_ids=torch.tensor([depth]),
                      attention_mask=mask[None, None], predict_at=predict_at, response_ids=responses,
                      response_mask=response_mask,
                      nominal_tokens=sum(len(p) + len(r) for p, r in zip(prompt_ids, response_ids)))


def group_rows(rows: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of ``rows`` in groups whose prefix trees hold at most ``max_tokens`` nodes each (a row longer than
    that alone), rows in sorted order so that neighbours share the most: each group is one forward pass."""
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    groups: list[list[int]] = []
    size = 0
    for i in order:
        if groups:
            shared = common_prefix(rows[groups[-1][-1]], rows[i])
            if size + len(rows[i]) - shared <= max_tokens:
                groups[-1].append(i)
                size += len(rows[i]) - shared
                continue
        groups.append([i])
        size = len(rows[i])
    return groups
