"""The hindsight tip on a TextWorldExpress trajectory (``TextWorldExpressEnv.hindsight_tip``), and the patterns that
read a room's name and exits from the simulator's text (also used by ``TextWorldExpressEnv.explore``)."""
from __future__ import annotations

import re
from typing import Any

_WASTE = ("look around", "inventory")  # actions that show but never change the state
ROOM = re.compile(r"You are in the ([\w -]+?)\.")
EXIT = re.compile(r"[Tt]o the (North|South|East|West) you see (?:a closed [\w -]+? door|the ([\w -]+?))\s*\.")
_OPENED = re.compile(r"You open the [\w -]+? door, revealing the ([\w -]+?)\s*\.")
_RECIPE = re.compile(r"Directions:\s*(.+)", re.DOTALL)


def textworld_express_tip(record: dict[str, Any]) -> list[str]:
    """The hindsight tip on a TextWorldExpress trajectory (``Environment.hindsight_tip``): the rooms seen, where the
    coin was seen (or that it was not), the exits never taken; for CookingWorld the recipe's directions when the
    cookbook was read."""
    actions, observations, score = record["actions"], record["observations"], float(record["score"])
    top = float(record.get("max_score", 1.0))
    views = [record["initial_observation"], *observations]
    rooms: list[str] = []
    coin_room = None
    exits: dict[str, dict[str, str | None]] = {}  # room -> direction -> the room it leads to (None: closed door)
    room = None
    for k, view in enumerate(views):
        found = ROOM.search(view)
        if found:
            room = found.group(1)
            rooms += [room] if room not in rooms else []
            if re.search(r"\ba coin\b", view):
                coin_room = room
            for direction, leads_to in EXIT.findall(view):
                exits.setdefault(room, {})[direction.lower()] = leads_to or None
        opened = _OPENED.search(view)
        if opened and room and k > 0 and actions[k - 1].startswith("open door to "):
            # the door opened is the one the action named: its exit now leads to the room it revealed
            exits.setdefault(room, {})[actions[k - 1].rsplit(" ", 1)[-1]] = opened.group(1)
    key = [a for a in actions if a not in _WASTE]
    if score >= top:
        where = f"The coin was in the {coin_room}. " if coin_room else ""
        return [f"Score {score:g}: worked. {where}{'; '.join(key)}.", "Repeat it with no extra look around."]
    waste = sum(a in _WASTE for a in actions)
    coin = "coin" in record["instruction"]
    # Coin Collector ends only at the coin or the step cap; CookingWorld also on a wrong step (which it does not name)
    out = [f"Score {score:g}: " + (f"I ran out of steps after {len(actions)} actions" if coin else
                                   f"the episode ended after {len(actions)} actions"
                                   + (f", the last {actions[-1]}" if actions else ""))
           + (f", {waste} of them needless look around or inventory" if waste else "") + "."]
    if coin:
        if coin_room:
            out.append(f"The coin is in the {coin_room}: go there and take coin.")
        else:
            unexplored = [f"{d} of the {r}" for r, ways in exits.items() for d, to in ways.items()
                          if to is None or to not in rooms]
            searched = f"No coin in the {', '.join(rooms)}." if rooms else "I never saw the coin."
            out.append(searched + (f" Next time try the exits {', '.join(unexplored)}." if unexplored else ""))
    else:
        recipe = next((_RECIPE.search(o) for o in observations if _RECIPE.search(o)), None)
        if recipe:
            out.append("The recipe says: " + "; ".join(line.strip() for line in recipe.group(1).splitlines()
                                                       if line.strip()) + ".")
        else:
            out.append("Next time take and read the cookbook first.")
    out.append(f"Done: {'; '.join(key)}." if key else "Nothing done.")
    return out
