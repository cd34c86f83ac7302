"""The environment contract shared by every text environment (docs/environments.md#the-contract).

Every environment is a plain Python object (not a gymnasium subclass, to keep workers light) with:

- ``reset(task: dict) -> (observation: str, info: dict)``
- ``step(response: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)``
  ``response`` is the policy's raw decoded text; the environment parses it into an action itself
  (e.g. ``<action>..</action>`` for WebShop, free text + optional action correction for ScienceWorld).
- ``tasks(split: str) -> list[dict]``: the task instances (JSON-serialisable dicts) of a split
  (``train`` / ``dev`` / ``test``); each dict is what ``reset`` accepts.
- ``close()``.
- ``system_prompt: str``: the environment's instructions to the agent (what it is, the action format).

``info`` always carries: ``score`` (float, environment units: points for ScienceWorld, [0,1] for WebShop),
``success`` (bool), ``won`` (bool, same as success), ``valid_action`` (bool), ``action`` (the parsed action
actually executed, str), ``task_id`` (str), ``variation`` (int or str), ``instruction`` (the task text the agent
sees), ``max_score`` (float), and ``admissible_actions`` (list[str]) when the environment can list them.
An invalid action is a no-op with ``valid_action=False``, never an exception. ``truncated`` is True when the
environment's own action cap is reached.

Both environments read the action with one rule, ``extract_action``: the first ``<action>`` tag wins, and
``info['format_ok']`` is False when a reply holds several tags or an unclosed one.
"""
from __future__ import annotations

import re

_OPEN_TAG = re.compile(r"<action>", re.IGNORECASE)
_CLOSE_TAG = re.compile(r"</action>", re.IGNORECASE)


def extract_action(response: str) -> tuple[str | None, bool]:
    """The action of a raw policy reply, by the rule every environment uses.

    Returns ``(action, well_formed)``. ``action``: the first non-empty line (stripped) of the first
    ``<action>`` tag's text, which ends at ``</action>`` or, for a reply cut at the token limit, at the end of
    the text; "" for an empty tag; None when the reply has no tag (each environment decides what that means).
    ``well_formed``: at most one ``<action>`` tag, and a tag present is closed. Tags are case-insensitive.
    """
    opens = list(_OPEN_TAG.finditer(response))
    if not opens:
        return None, True
    start = opens[0].end()
    close = _CLOSE_TAG.search(response, start)
    text = response[start:close.start() if close else len(response)]
    action = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return action, len(opens) == 1 and close is not None


# One command and nothing else: a WebShop search[...]/click[...] or a ScienceWorld command (its verbs, as in
# ScienceWorldEnv's action list), the way a policy trained on actions answers a prompt that asks for prose.
_BARE_COMMAND = re.compile(
    r"(?:search|click)\[[^\]]*\]|(?:open|close|go to|teleport to|look around|look at|look in|pick up|put down|"
    r"move|pour|mix|activate|deactivate|use|connect|read|eat|focus on|wait1?|inventory)\b[^.;:\n]*")


def is_action_reply(text: str) -> bool:
    """Whether a reply is an action rather than prose: it holds an ``<action>`` tag, or it is one bare command
    (``open door to hallway``, ``click[grey]``: ScienceWorld replies need no tag). Used to tell a reflection
    that is advice from one that is an action (``rollout/tip_action_frac``)."""
    return extract_action(text)[0] is not None or _BARE_COMMAND.fullmatch(text.strip().lower()) is not None
