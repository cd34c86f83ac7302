"""ScienceWorld on the real ``scienceworld`` simulator (Scala, via py4j): docs/environments.md#scienceworld.

Talks to the py4j server directly: the package's ``ScienceWorldEnv.step`` adds JVM round trips per action (look,
inventory, task description, the ~1000 valid actions) that this needs only for correction or admissible actions.
"""
from __future__ import annotations

import numbers
import re
from typing import Any

from src.envs.base import JvmEnvironment, jvm_problems, launch_jvm, read_action
from src.envs.scienceworld_demos import scienceworld_tip
from src.envs.scienceworld_tasks import default_max_steps, resolve_task, settings_problems, task_list

MAX_SCORE = 100.0

# Replies of the simulator's input parser when it executed nothing (strings found in the jar's InputParser and
# PythonInterface classes): such an action is an invalid no-op.
_INVALID_PREFIXES = (
    "No known action matches that input.",
    "Unknown action.",
    "ERROR:",
    "Ambiguous request: Multiple different possible actions",
)
_AMBIGUOUS_PROMPT = "Ambiguous request: Please enter the number"
_AMBIGUOUS_OPTION = re.compile(r"^\s*(\d+):\s*(.+?)\s*$")
# "reset task" is in the simulator's action list; it would silently restart the episode under the agent.
_BLOCKED_ACTIONS = {"reset task"}


def _blocked(action: str) -> bool:
    return " ".join(action.lower().split()) in _BLOCKED_ACTIONS


def parse_action(response: str) -> str:
    """The action of a raw policy reply by ``src.envs.base.read_action``; "" when there is none."""
    return read_action(response)[0]


def start_jvm(jvm_heap: str):
    """Start one simulator JVM (the package's object; only its py4j ``server`` steps).

    Raises:
        ValueError: no ``java`` on PATH (says how to install Java 17), or ``jvm_heap`` is not a JVM size.
    """
    problems = jvm_problems({"_target_": "src.envs.scienceworld.ScienceWorldEnv", "jvm_heap": jvm_heap},
                            "ScienceWorld")
    if problems:
        raise ValueError("\n".join(problems))
    from scienceworld import ScienceWorldEnv as _PackageEnv

    # hashCode=2 (a constant identity hash): the simulator lists same-named objects in hash-set order, which under
    # the default random hash depends on what the JVM ran before; a constant hash leaves creation order.
    return launch_jvm(lambda: _PackageEnv(""), jvm_heap, "-XX:+UnlockExperimentalVMOptions -XX:hashCode=2")


class ScienceWorldEnv(JvmEnvironment):
    """One ScienceWorld simulator (one JVM) behind the contract of ``src/envs/base.py``.

    Args:
        task: a task or a list of them (those ``tasks(split)`` lists; ``reset`` takes any), each an alphabetical
            index (0..29; power-component = 25), a paper id ("3-1") or a name.
        simplification: "easy" (the paper's preset: teleportAction, openDoors, openContainers,
            selfWateringFlowerPots, noElectricalAction) or a comma-separated list of the simulator's.
        num_train_variations: train split = the first this many of ``get_variations_train()`` (paper: 5).
        num_test_variations: test and dev splits = the first up to this many of ``get_variations_test()`` /
            ``get_variations_dev()`` (paper: 20; some tasks have fewer).
        max_steps: action cap per episode, every step call counting; None = ``default_max_steps`` of the task (the
            simulator's envStepLimit counts ticks and is not used).
        action_correction: an action the parser rejects (it always runs as written first: the valid-action list
            omits many it accepts, e.g. ``examine OBJ``) is replaced by the most similar valid action (thefuzz
            ratio) scoring at least ``correction_min_similarity`` (85: "go to the kitchen" -> "go to kitchen" (87)
            is repaired, "focus on the water" -> "focus on sewer" (81) is not); ``info['corrected']`` says so.
        include_admissible_actions: put the sorted valid-action list (~1000 strings, ~50-500 ms) in ``info``.
        seed: accepted so every environment takes the same config keys; the simulator exposes no seed.

    Scores are points, −100..100; reward = score delta since the previous step (from the score after reset, as in
    the package: initial 0 in most tasks, 8 in find-*). A wrong ``focus on`` scores −100 and terminates, as in the
    package, so one step's reward lies in −200..100. success = completed and score ≥ 100. When the simulator asks
    which of several objects an action meant, the option whose text sorts first runs (the listed order varies
    between JVM runs); ``info['action']`` names it.

    Raises:
        ValueError: a setting ``config_problems`` refuses (an unknown task lists the valid ones; no ``java`` on PATH
            says how to install Java 17), an unknown simplification, a bad split or variation.
        RuntimeError: step before reset or after the end.
    """

    display_name = "ScienceWorld"
    score_unit = "points"
    max_score = MAX_SCORE
    novelty_coef = 1.0  # points (-100..100)
    # one command without tags: the simulator's verbs (its action list), as a policy trained on actions writes it
    bare_command = re.compile(r"(?:open|close|go to|teleport to|look around|look at|look in|pick up|put down|"
                              r"move|pour|mix|activate|deactivate|use|connect|read|eat|focus on|wait1?|"
                              r"inventory)\b[^.;:\n]*")

    def __init__(self, task: str | int | list[str | int] = "find-non-living-thing", simplification: str = "easy",
                 num_train_variations: int = 5, num_test_variations: int = 20, max_steps: int | None = None,
                 action_correction: bool = False, correction_min_similarity: int = 85,
                 include_admissible_actions: bool = False, jvm_heap: str = "768m", seed: int | None = None) -> None:
        self.check_config({"task": task, "num_train_variations": num_train_variations, "max_steps": max_steps,
                           "num_test_variations": num_test_variations, "jvm_heap": jvm_heap,
                           "correction_min_similarity": correction_min_similarity})
        self.task_names = [resolve_task(t) for t in task_list(task)]  # checked above
        self.simplification = simplification
        self.num_train_variations = num_train_variations
        self.num_test_variations = num_test_variations
        self.max_steps = max_steps
        self.action_correction = action_correction
        self.correction_min_similarity = correction_min_similarity
        self.include_admissible_actions = include_admissible_actions
        self.seed = seed

        self._sim = start_jvm(jvm_heap)
        self._server = self._sim.server
        self._closed = False
        try:
            self._check_simplification()
            self._splits = {name: self._variation_splits(name) for name in dict.fromkeys(self.task_names)}
        except BaseException:
            self.close()
            raise

        self._task_name: str | None = None
        self._variation: int | None = None
        self._instruction = ""
        self._cap = 0
        self._steps = 0
        self._score = 0
        self._done = True
        self.system_prompt = self._make_system_prompt()

    @classmethod
    def config_problems(cls, env_cfg: dict[str, Any], training: bool = False) -> list[str]:
        """``scienceworld_tasks.settings_problems`` and the JVM's needs (Java on PATH, the heap size); the
        simplification preset needs the simulator and is checked when it starts."""
        return settings_problems(cls.with_defaults(env_cfg), training) + jvm_problems(env_cfg, "ScienceWorld")

    def _check_simplification(self) -> None:
        allowed = ["easy"] + str(self._server.getPossibleSimplifications()).split(", ")
        bad = [s for s in self.simplification.split(",") if s and s not in allowed]
        if bad:
            raise ValueError(f"simplification={self.simplification!r}: unknown part(s) {bad}; expected a "
                             f"comma-separated subset of {allowed}")

    def _variation_splits(self, name: str) -> dict[str, list[int]]:
        self._load(name, 0)  # the server answers the split lists only for the loaded task
        return {"train": list(self._server.getVariationsTrain()),
                "dev": list(self._server.getVariationsDev()),
                "test": list(self._server.getVariationsTest())}

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """Task instances ``{"task_name": str, "variation": int}`` of every configured task: train, the first
        ``num_train_variations`` train variations; dev/test, the first up to ``num_test_variations``. Raises ValueError
        for another split."""
        limits = {"train": self.num_train_variations, "dev": self.num_test_variations,
                  "test": self.num_test_variations}
        if split not in limits:
            raise ValueError(f"split={split!r}: expected one of {sorted(limits)}")
        return [{"task_name": name, "variation": int(v)}
                for name, splits in self._splits.items() for v in splits[split][:limits[split]]]

    def _load(self, name: str, variation: int) -> None:
        max_var = int(self._server.getTaskMaxVariations(name))
        if not 0 <= variation < max_var:
            raise ValueError(f"variation={variation} for task {name!r}: expected 0..{max_var - 1}")
        msg = self._server.load(name, variation, self.simplification, False)
        if msg and str(msg).startswith("ERROR"):
            raise ValueError(f"ScienceWorld refused task {name!r} variation {variation}: {msg}")

    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Start ``{"task_name": <index|paper id|name>, "variation": int}``: the task description and the "look
        around" text, and ``info`` (``instruction``: the description without its header)."""
        if not isinstance(task, dict) or "task_name" not in task or "variation" not in task:
            raise ValueError(f"task={task!r}: expected a dict with keys 'task_name' and 'variation'")
        name = resolve_task(task["task_name"])
        variation = task["variation"]
        if isinstance(variation, bool) or not isinstance(variation, numbers.Integral):
            raise ValueError(f"variation={variation!r}: expected an int")
        variation = int(variation)
        self._load(name, variation)
        self._server.reset()  # then "look around", as the package's load() does
        look = str(self._server.step("look around"))
        description = str(self._server.freeActionTaskDesc()).strip()
        self._instruction = re.sub(r"^Task Description:\s*", "", description)
        self._task_name, self._variation = name, variation
        self._cap = self.max_steps if self.max_steps is not None else default_max_steps(name)
        self._steps = 0
        self._score = self._read_score()
        self._done = False
        observation = f"{description}\n\n{look.strip()}"
        info = self._info(action="look around", raw_action="", valid=True, success=False)
        return observation, info

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run one action parsed from the policy's raw text: (observation, reward in points, terminated, truncated,
        info). Raises RuntimeError before ``reset`` or after the episode ended."""
        if self._task_name is None:
            raise RuntimeError("ScienceWorldEnv.step() called before reset()")
        if self._done:
            raise RuntimeError("ScienceWorldEnv.step() called after the episode ended; call reset() first")
        action, format_ok = read_action(response)
        observation, executed, valid = self._execute(action)
        corrected = False
        if not valid and self.action_correction and action and not _blocked(action):
            # The parser rejected the action (a no-op: the simulator's move counter does not advance), so
            # trying it first changes nothing; only now is it mapped to a close valid action, if there is one.
            replacement = self._nearest_valid_action(action)
            if replacement is not None:
                observation, executed, valid = self._execute(replacement)
                corrected = True
        self._steps += 1
        score = self._read_score()
        completed = bool(self._server.getCompleted())
        reward, self._score = float(score - self._score), score
        terminated = completed or score < 0
        truncated = not terminated and self._steps >= self._cap
        self._done = terminated or truncated
        success = completed and score >= MAX_SCORE
        info = self._info(action=executed, raw_action=response, valid=valid, success=success)
        info.update(format_ok=format_ok, corrected=corrected)
        return observation, reward, terminated, truncated, info

    def _execute(self, action: str) -> tuple[str, str, bool]:
        """Send one action; returns (observation, action actually run, accepted by the simulator)."""
        if not action:
            return "No action given. Reply with one action command, e.g. 'look around'.", "", False
        if _blocked(action):
            return f"The action '{action}' is not available in this environment.", action, False
        observation = str(self._server.step(action))
        if observation.startswith(_AMBIGUOUS_PROMPT):
            options = [m.groups() for m in map(_AMBIGUOUS_OPTION.match, observation.splitlines()[1:]) if m]
            if options:
                number, action = min(options, key=lambda opt: opt[1])
                observation = str(self._server.step(number))
            else:  # unreadable option list: cancel (blank answer) rather than leave the parser waiting
                observation = "ERROR: " + str(self._server.step(""))
        valid = not observation.startswith(_INVALID_PREFIXES)
        return observation.strip(), action, valid

    def _nearest_valid_action(self, action: str) -> str | None:
        """The valid action most similar to ``action`` (thefuzz ratio after lower-casing and stripping
        punctuation) if it scores at least ``correction_min_similarity``, else None."""
        from thefuzz import fuzz, process, utils

        if not utils.full_process(action):  # no letters or digits: nothing to compare
            return None
        match = process.extractOne(action, self._valid_actions(), scorer=fuzz.ratio,
                                   score_cutoff=self.correction_min_similarity)
        return match[0] if match else None

    def _read_score(self) -> int:
        # Same conversion as the package: simulator score in [-1, 1] -> rounded points.
        return int(round(100 * float(self._server.getScore())))

    def _valid_actions(self) -> list[str]:
        # Sorted: the simulator's order is not stable across runs, and fuzzy-match ties take the first.
        actions = {str(a) for a in self._server.getValidActionObjectCombinations()}
        return sorted(actions - _BLOCKED_ACTIONS)

    def _info(self, action: str, raw_action: str, valid: bool, success: bool) -> dict[str, Any]:
        info: dict[str, Any] = {
            "score": float(self._score), "max_score": MAX_SCORE, "success": success, "won": success,
            "valid_action": valid, "action": action, "raw_action": raw_action, "task_id": self._task_name,
            "variation": self._variation, "instruction": self._instruction, "steps": self._steps,
            "max_steps": self._cap,
        }
        if self.include_admissible_actions:
            info["admissible_actions"] = self._valid_actions()
        return info

    def _make_system_prompt(self) -> str:
        commands = ["look around", "look at OBJ", "look in OBJ", "go to LOCATION"]
        if "easy" in self.simplification or "teleportAction" in self.simplification:
            commands.append("teleport to LOCATION")
        commands += ["open OBJ", "close OBJ", "pick up OBJ", "put down OBJ", "move OBJ to OBJ", "pour OBJ in OBJ",
                     "mix OBJ", "activate OBJ", "deactivate OBJ", "use OBJ on OBJ", "connect OBJ to OBJ",
                     "read OBJ", "eat OBJ", "focus on OBJ", "wait1", "inventory"]
        return ("You are an agent in ScienceWorld, a text-based simulation of a house with a kitchen, workshop, "
                "greenhouse, outdoor area and other rooms, where you carry out elementary-school science tasks "
                "by typing commands.\n"
                "Reply with exactly one action command and nothing else. Commands (OBJ and LOCATION are names "
                "from the observation): " + "; ".join(commands) + ".\n"
                "Use 'focus on OBJ' only on the object the task tells you to focus on: focusing on a wrong "
                "object ends the task as a failure.")

    @classmethod
    def startup_warnings(cls, env_cfg: dict[str, Any]) -> None:
        """Warn when the action cap cuts a task's gold path short (``scienceworld_gold_lengths``)."""
        from src.envs.scienceworld_gold_lengths import warn_gold_paths_over_cap

        warn_gold_paths_over_cap(env_cfg)

    @classmethod
    def warm_start_config(cls, env_cfg: dict[str, Any], num_tasks: int | None) -> dict[str, Any]:
        """Every training variation has a gold path, so the warm start may imitate more of them than RL trains on
        (RL keeps the paper's first 5): ``num_tasks`` training variations of each task (None: those RL trains on)."""
        return env_cfg if num_tasks is None else {**env_cfg, "num_train_variations": int(num_tasks)}

    def warm_start_tasks(self, num_tasks: int | None) -> list[dict[str, Any]]:
        return self.tasks("train")  # num_train_variations already says how many (warm_start_config)

    def demonstrations(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[dict]:
        """The gold paths of ``tasks``, cut to the action cap (``scienceworld_demos.gold_records``)."""
        from src.envs.scienceworld_demos import gold_records

        return gold_records(tasks, env_cfg, data_dir)

    def reflection_records(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str
                           ) -> list[dict]:
        """Per variation the gold path and the gold path after needless looks, replayed here under the step cap
        (cached next to the gold paths: ``scienceworld_demos.cached_replays``)."""
        from src.envs.scienceworld_demos import cached_replays, env_gold

        return cached_replays(self, env_cfg, tasks, env_gold(tasks, env_cfg, data_dir), data_dir)

    def oracle_tips(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[list[str]]:
        """Diagnostic only (``Environment.oracle_tips``): the simulator's gold path of each variation (generated into
        the gold cache ``data_dir`` where missing)."""
        from src.envs.scienceworld_demos import env_gold

        return [[f"The solution: {'; '.join(record['actions'])}."] for record in env_gold(tasks, env_cfg, data_dir)]

    hindsight_tip = staticmethod(scienceworld_tip)


__all__ = ["ScienceWorldEnv", "resolve_task", "default_max_steps", "parse_action", "start_jvm"]
