"""TextWorldExpress on the real simulator (Scala, via py4j): docs/environments.md#textworldexpress. Games: ``coin``
(Coin Collector: explore rooms until the coin is seen, ``take coin``) and ``cookingworld`` (read the cookbook,
prepare the ingredients, ``prepare meal``, ``eat meal``). A game instance is a seed of one of the simulator's
disjoint folds (train 0-999, dev 10000-10999, test 20000-20999).
"""
from __future__ import annotations

import numbers
import random
import re
from collections.abc import Mapping
from typing import Any

from src.envs.base import JvmEnvironment, count_problem, jvm_problems, launch_jvm, read_action, replay
from src.envs.textworld_express_tips import EXIT, ROOM, textworld_express_tip

GAMES = ("coin", "cookingworld")
FOLDS = {"train": "train", "dev": "dev", "test": "test"}
# The simulator's answers to an action it did not carry out (strings of its jar): an invalid no-op.
_INVALID_PREFIXES = ("Unknown action", "You can't")


def _params(game_params: dict[str, Any]) -> str:  # "key=value,key=value", booleans 0/1
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in game_params.items())


class TextWorldExpressEnv(JvmEnvironment):
    """One TextWorldExpress simulator (one JVM) behind the contract of ``src/envs/base.py``.

    Args:
        game: ``coin`` or ``cookingworld``.
        game_params: the simulator's generation parameters, e.g. ``{"numLocations": 4, "includeDoors": 1,
            "numDistractorItems": 0}`` for coin; one the game does not know raises.
        num_train_seeds: train split = the first this many seeds of the train fold (0, 1, ...).
        num_test_seeds: the same for the test fold (20000, ...) and the dev fold.
        max_steps: actions per episode (every step call counts); reaching it truncates.
        include_admissible_actions: list the simulator's valid actions (sorted; ~5-15 short strings) in ``info``.
        seed: accepted so every environment takes the same config keys; a game is fixed by its task's seed.

    Scores are the simulator's, in [0, 1] (cookingworld: the share of the recipe done); reward = score delta; a
    task failure (e.g. eating an ingredient raw) terminates with success False.

    Raises:
        ValueError: a setting ``config_problems`` refuses (also no ``java`` on PATH), a game parameter or seed count
            the simulator refuses, a task seed outside its fold.
        RuntimeError: step before reset or after the episode ended.
    """

    display_name = "TextWorldExpress"
    score_unit = "score in [0, 1]"
    max_score = 1.0
    novelty_coef = 0.01  # 1% of the best score, the same share as ScienceWorld's 1 point of 100
    bare_command = re.compile(r"(?:look around|inventory|move|open|close|take|put|drop|read|slice|chop|dice|cook|"
                              r"prepare meal|eat)\b[^.;:\n]*")

    def __init__(self, game: str = "coin", game_params: dict[str, Any] | None = None, num_train_seeds: int = 100,
                 num_test_seeds: int = 50, max_steps: int = 20, include_admissible_actions: bool = True,
                 jvm_heap: str = "256m", seed: int | None = None) -> None:
        self.check_config({"_target_": f"{__name__}.{type(self).__name__}", "game": game, "max_steps": max_steps,
                           "game_params": game_params, "num_train_seeds": num_train_seeds,
                           "num_test_seeds": num_test_seeds, "jvm_heap": jvm_heap})
        from textworld_express import TextWorldExpressEnv as _Simulator

        self.game, self.game_params = game, dict(game_params or {})
        self.num_train_seeds, self.num_test_seeds = num_train_seeds, num_test_seeds
        self.max_steps, self.include_admissible_actions, self.seed = max_steps, include_admissible_actions, seed
        self._sim = launch_jvm(lambda: _Simulator(envStepLimit=10 ** 9), jvm_heap)  # our cap (max_steps) ends episodes
        self._closed = False
        try:
            self._sim.load(game, _params(self.game_params))
        except Exception as exc:
            self.close()
            raise ValueError(f"env.game_params={self.game_params!r} for game {game!r}: the simulator says "
                             f"{exc}") from exc
        self._folds = {"train": self._sim.getValidSeedsTrain(), "dev": self._sim.getValidSeedsDev(),
                       "test": self._sim.getValidSeedsTest()}
        for name, count, fold in (("num_train_seeds", num_train_seeds, "train"),
                                  ("num_test_seeds", num_test_seeds, "test")):
            if count > len(self._folds[fold]):
                self.close()
                raise ValueError(f"{name}={count}: the {fold} fold holds {len(self._folds[fold])} seeds")
        self._seeds = {fold: set(seeds) for fold, seeds in self._folds.items()}
        self._task: dict[str, Any] | None = None
        self._done = True
        self._steps = 0
        self._score = 0.0
        self._valid: list[str] = []
        self._instruction = ""
        self.system_prompt = self._make_system_prompt()

    @classmethod
    def config_problems(cls, env_cfg: dict[str, Any], training: bool = False) -> list[str]:
        """The game, its parameters' type, the seed counts, the action cap and the JVM's needs; the parameters'
        values and the folds' sizes are the simulator's to check (when it starts)."""
        env_cfg = cls.with_defaults(env_cfg)
        game, params = env_cfg["game"], env_cfg["game_params"]
        problems = [] if game in GAMES else [f"env.game={game!r}: expected one of {list(GAMES)}"]
        if params is not None and not isinstance(params, Mapping):
            problems.append(f"env.game_params={params!r}: expected a mapping of the simulator's game parameters "
                            "(e.g. numLocations: 4) or null")
        problems += count_problem("num_train_seeds", env_cfg["num_train_seeds"], int(training), "train seeds")
        problems += count_problem("num_test_seeds", env_cfg["num_test_seeds"], 0, "dev/test seeds")
        problems += count_problem("max_steps", env_cfg["max_steps"], 1, "actions per episode")
        return problems + jvm_problems(env_cfg, "TextWorldExpress")

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """Task instances ``{"task_name": game, "variation": seed, "fold": split}``: the first ``num_train_seeds``
        seeds of the train fold, or ``num_test_seeds`` of the dev/test fold. Raises ValueError for another split."""
        if split not in FOLDS:
            raise ValueError(f"split={split!r}: expected one of {sorted(FOLDS)}")
        count = self.num_train_seeds if split == "train" else self.num_test_seeds
        return [{"task_name": self.game, "variation": int(s), "fold": split} for s in self._folds[split][:count]]

    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Start the game of ``{"variation": seed, "fold": "train"|"dev"|"test"}`` (``task_name``, when given,
        must be this environment's game): the task description followed by the first room's description, and
        ``info``."""
        seed, fold = self._check_task(task)
        observation, raw = self._sim.reset(seed=seed, gameFold=fold)
        self._task = {"task_name": self.game, "variation": seed, "fold": fold}
        self._instruction = str(raw["taskDescription"]).strip()
        self._steps, self._score, self._done = 0, float(raw["score"]), False
        self._valid = sorted(raw["validActions"])
        info = self._info(action="look around", raw_action="", valid=True, success=False)
        return f"{self._instruction}\n\n{observation.strip()}", info

    def _check_task(self, task: dict[str, Any]) -> tuple[int, str]:
        """(seed, fold) of a task dict. Raises ValueError for another game, an unknown fold or a seed outside it."""
        if not isinstance(task, dict) or "variation" not in task or "fold" not in task:
            raise ValueError(f"task={task!r}: expected a dict with keys 'variation' (a seed) and 'fold'")
        if task.get("task_name", self.game) != self.game:
            raise ValueError(f"task_name={task['task_name']!r}: this environment plays {self.game!r}")
        seed, fold = task["variation"], task["fold"]
        if fold not in FOLDS:
            raise ValueError(f"fold={fold!r}: expected one of {sorted(FOLDS)}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or int(seed) not in self._seeds[fold]:
            lo, hi = min(self._folds[fold]), max(self._folds[fold])
            raise ValueError(f"variation={seed!r}: expected a seed of the {fold} fold ({lo}..{hi})")
        return int(seed), fold

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run one action parsed from the policy's raw text: (observation, reward, terminated, truncated, info).
        Raises RuntimeError before ``reset`` or after the episode ended."""
        if self._task is None:
            raise RuntimeError("TextWorldExpressEnv.step() called before reset()")
        if self._done:
            raise RuntimeError("TextWorldExpressEnv.step() called after the episode ended; call reset() first")
        action, format_ok = read_action(response)
        self._steps += 1
        if action:
            observation, _, _, raw = self._sim.step(action)
            valid = not observation.startswith(_INVALID_PREFIXES)
            success, failure = bool(raw["tasksuccess"]), bool(raw["taskfailure"])
            reward, self._score = float(raw["score"]) - self._score, float(raw["score"])
            self._valid = sorted(raw["validActions"])
        else:  # the simulator would answer "Unknown action" too; no round trip for nothing
            observation, valid, success, failure, reward = "No action given. Reply with one action.", False, False, \
                False, 0.0
        terminated = success or failure
        truncated = not terminated and self._steps >= self.max_steps
        self._done = terminated or truncated
        info = self._info(action=action, raw_action=response, valid=valid, success=success)
        info["format_ok"] = format_ok
        return observation.strip(), reward, terminated, truncated, info

    def _info(self, action: str, raw_action: str, valid: bool, success: bool) -> dict[str, Any]:
        info = {"score": self._score, "max_score": 1.0, "success": success, "won": success, "valid_action": valid,
                "action": action, "raw_action": raw_action, "task_id": self.game,
                "variation": self._task["variation"], "instruction": self._instruction, "steps": self._steps,
                "max_steps": self.max_steps}
        if self.include_admissible_actions:
            info["admissible_actions"] = list(self._valid)
        return info

    def gold_actions(self, task: dict[str, Any]) -> list[str]:
        """A gold action path of ``task``, the same in every run and on every machine. Coin Collector: ``explore``
        (the simulator's own is drawn at random by an unseeded JVM generator). CookingWorld: the simulator's gold path
        (the same on every call), without its leading ``look around``, which ``reset`` already shows."""
        seed, fold = self._check_task(task)
        if self.game == "coin":
            return self.explore(task)
        self._sim.reset(seed=seed, gameFold=fold, generateGoldPath=True)
        actions = [str(a) for a in self._sim.getGoldActionSequence()]
        self._done = True  # the simulator restarted for the gold path: a new reset() is needed
        return actions[1:] if actions and actions[0] == "look around" else actions

    def explore(self, task: dict[str, Any]) -> list[str]:
        """Coin Collector's gold path, explored as an agent must (never straight to an unseen coin): depth-first over
        the rooms, trying each new room's other exits in an order shuffled by the seed (so demonstrations prefer no
        direction), opening closed doors, skipping rooms in sight that were seen, backing out of dead ends; then
        ``take coin``. Not bounded by ``max_steps``.

        Raises:
            RuntimeError: every room seen, or 200 actions, and no coin in sight, or a room the simulator describes
                without its name (not a Coin Collector game as the simulator describes them)."""
        seed, fold = self._check_task(task)
        rng = random.Random(seed)
        opposite = {"north": "south", "south": "north", "east": "west", "west": "east"}
        actions: list[str] = []

        def act(action: str) -> dict:
            actions.append(action)
            return self._sim.step(action)[3]

        def exits(look: str) -> dict[str, str | None]:  # direction -> the room in sight there (None: closed door)
            return {m.group(1).lower(): m.group(2) for m in EXIT.finditer(look)}

        def room_of(look: str) -> str:
            found = ROOM.search(look)
            if found is None:
                raise RuntimeError(f"explore({task}): no room name in {look!r}")
            return found.group(1)

        def shuffled(directions) -> list[str]:
            order = sorted(directions)
            rng.shuffle(order)
            return order

        _, raw = self._sim.reset(seed=seed, gameFold=fold)
        self._done = True  # stepped here, not through step(): a new reset() is needed
        room = room_of(raw["look"])
        untried, came_by = {room: shuffled(exits(raw["look"]))}, []  # exits left per room; the way into the room
        while "take coin" not in raw["validActions"]:
            if len(actions) >= 200 or not (untried[room] or came_by):
                raise RuntimeError(f"explore({task}): no coin in sight after {actions}")
            if not untried[room]:
                raw = act(f"move {opposite[came_by.pop()]}")
                room = room_of(raw["look"])
                continue
            direction = untried[room].pop()
            if exits(raw["look"]).get(direction, "") is None:  # closed now (it may have been opened from behind)
                raw = act(f"open door to {direction}")
            if exits(raw["look"]).get(direction) in untried:  # a room in sight that was seen before
                continue
            raw = act(f"move {direction}")
            room = room_of(raw["look"])
            untried.setdefault(room, [d for d in shuffled(exits(raw["look"])) if d != opposite[direction]])
            came_by.append(direction)
        act("take coin")
        return actions

    def _make_system_prompt(self) -> str:
        what = {"coin": "The house is a set of rooms joined by doors; a coin lies in one of them. Explore until you "
                        "see it, then take it. Doors may be closed: open them to go through.",
                "cookingworld": "Cook a meal: find and read the cookbook, gather its ingredients, prepare them as "
                                "its directions say, then prepare the meal and eat it."}[self.game]
        return ("You are an agent in a text-based house (TextWorldExpress), acting by typing commands.\n" + what +
                "\nReply with exactly one action command and nothing else, e.g. 'move north', 'open door to "
                "south', 'take coin', 'look around'. When the valid actions are listed, pick one of them.")

    @classmethod
    def warm_start_config(cls, env_cfg: dict[str, Any], num_tasks: int | None) -> dict[str, Any]:
        """Every training seed has a gold path, so the warm start may imitate more seeds than RL trains on:
        ``num_tasks`` training seeds (None: those RL trains on)."""
        return env_cfg if num_tasks is None else {**env_cfg, "num_train_seeds": int(num_tasks)}

    def demonstrations(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[dict]:
        """The gold path of each training task (``gold_actions``) without its loops (``without_loops``),
        replayed here under the step cap."""
        return [replay(self, task, self.without_loops(task, self.gold_actions(task))) for task in tasks]

    def without_loops(self, task: dict[str, Any], actions: list[str]) -> list[str]:
        """``actions`` without loops that show nothing new (back to the same observation, every one on the way seen
        before the loop), which would teach an imitating policy to pace between rooms, as the simulator's gold paths
        do. A cut is kept only if its replay ends with at least the same score under the step cap."""
        def states(path: list[str]) -> tuple[list[str], float]:
            record = replay(self, task, path)
            # the first room as a later "look around" shows it: the reset text also holds the task description
            first = record["initial_observation"].split("\n\n", 1)[-1]
            return [first, *record["observations"]], record["score"]

        seen, score = states(actions)
        path = list(actions)
        while True:  # cut the loop that ends first (then starts first) and keeps the score, until none does
            for i, j in ((i, j) for j in range(1, len(seen)) for i in range(j)
                         if seen[i] == seen[j] and set(seen[i + 1:j]) <= set(seen[:i + 1])):
                candidate = path[:i] + path[j:]
                new_seen, new_score = states(candidate)
                # at least the score: a path cut under the step cap may now finish where it did not
                if new_score >= score:
                    path, seen, score = candidate, new_seen, new_score
                    break
            else:
                return path

    def reflection_records(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[dict]:
        """Per training task the gold path without its loops and a random walk (seeded by the task) over moves, doors
        and ingredient actions, never the one that finishes, so it runs out of steps or fails the recipe."""
        return [record for task in tasks for record in (
            replay(self, task, self.without_loops(task, self.gold_actions(task))),
            replay(self, task, self._random_walk(task)))]

    def oracle_tips(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[list[str]]:
        """Diagnostic only (``Environment.oracle_tips``): where the coin is (coin) and the gold path without its
        loops (``gold_actions``)."""
        out = []
        for task in tasks:
            path = self.without_loops(task, self.gold_actions(task))
            record = replay(self, task, path)
            rooms = [m.group(1) for v in [record["initial_observation"], *record["observations"]]
                     for m in [ROOM.search(v)] if m]
            lines = [f"The coin is in the {rooms[-1]}."] if self.game == "coin" and rooms else []
            out.append(lines + [f"The way: {'; '.join(path)}."])
        return out

    def _random_walk(self, task: dict[str, Any]) -> list[str]:
        rng = random.Random(int(task["variation"]))
        self.reset(task)
        actions: list[str] = []
        while not self._done:
            moves = [a for a in self._valid if a.startswith(("move", "open", "take", "read", "slice", "chop", "dice",
                                                              "cook")) and a != "take coin"]
            action = rng.choice(moves or ["look around"])
            actions.append(action)
            self.step(action)
        return actions

    hindsight_tip = staticmethod(textworld_express_tip)


__all__ = ["TextWorldExpressEnv", "textworld_express_tip", "GAMES"]
