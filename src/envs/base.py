"""The environment contract (docs/environments.md#the-contract) and ``Environment``, the class every environment
derives from (docs/extending.md). An environment is a plain Python object (not gymnasium, to keep workers light):

- ``reset(task: dict) -> (observation: str, info: dict)``
- ``step(response: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)``,
  ``response`` being the policy's raw decoded text, which the environment parses into an action itself.
- ``tasks(split: str) -> list[dict]``: the JSON-serialisable task dicts of ``train`` / ``dev`` / ``test``, each
  what ``reset`` accepts; ``close()``; ``system_prompt: str``, the instructions to the agent.

``info`` always carries: ``score`` (float, environment units: points for ScienceWorld, [0,1] for WebShop),
``success`` (bool), ``won`` (bool, same as success), ``valid_action`` (bool), ``action`` (the parsed action
actually executed, str), ``task_id`` (str), ``variation`` (int or str), ``instruction`` (the task text the agent
sees), ``max_score`` (float), ``admissible_actions`` (list[str]) when the environment can list them, and after a
step ``format_ok`` (bool: ``extract_action``'s ``well_formed``, the one rule every environment reads actions by).
An invalid action is a no-op with ``valid_action=False``, never an exception. ``truncated`` is True when the
environment's own action cap is reached.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Callable

from src.utils.environ import temporary_environ

_JVM_SIZE = re.compile(r"^\d+[kKmMgG]?$")
_OPEN_TAG = re.compile(r"<action>", re.IGNORECASE)
_CLOSE_TAG = re.compile(r"</action>", re.IGNORECASE)


def count_problem(key: str, value: Any, minimum: int, meaning: str, allow_none: bool = False) -> list[str]:
    """``[message]`` when ``env.<key>`` is not an int >= ``minimum`` (None allowed with ``allow_none``), else []."""
    if (value is None and allow_none) or (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        return []
    return [f"env.{key}={value!r}: expected an int >= {minimum}{' or null' if allow_none else ''} ({meaning})"]


def jvm_problems(env_cfg: dict[str, Any], name: str) -> list[str]:
    """A simulator JVM's needs, checked without starting it: ``java`` on PATH and ``env.jvm_heap`` a JVM size."""
    import shutil

    problems = [] if shutil.which("java") else [
        f"env._target_={env_cfg.get('_target_')!r}: {name} needs a Java runtime (Java 17) but `java` is not on "
        "PATH; install it (e.g. apt-get install openjdk-17-jre-headless) or put a JDK's bin/ on PATH"]
    heap = env_cfg.get("jvm_heap")
    if heap is not None and not _JVM_SIZE.match(str(heap)):
        problems.append(f"env.jvm_heap={heap!r}: expected a JVM heap size like '768m' or '2g' (-Xmx of each JVM)")
    elif heap is not None and jvm_bytes(heap) < MIN_JVM_HEAP:
        problems.append(f"env.jvm_heap={heap!r}: too small for a simulator's JVM (it dies at start-up); expected at "
                        "least 128m (768m ScienceWorld's default, 256m TextWorldExpress's)")
    return problems


MIN_JVM_HEAP = 128 * 2**20
JVM_OVERHEAD = 256 * 2**20  # what a worker holds beyond the JVM's heap: the JVM's own code and threads, Python


def jvm_bytes(size: str) -> int:
    """A JVM size (``768m``, ``2g``, ``1048576``) in bytes."""
    size = str(size)
    scale = {"k": 2**10, "m": 2**20, "g": 2**30}.get(size[-1].lower(), 1)
    return int(size.rstrip("kKmMgG")) * scale


def launch_jvm(factory: Callable[[], Any], jvm_heap: str, flags: str = "") -> Any:
    """``factory()``, which starts a simulator's JVM, with max heap ``jvm_heap`` (uncapped, one grows to ~3.5 GB),
    the serial GC (the default runs a thread per core) and ``flags``, set in ``JAVA_TOOL_OPTIONS`` only meanwhile."""
    with temporary_environ("JAVA_TOOL_OPTIONS", f"-Xmx{jvm_heap} -XX:+UseSerialGC {flags}".rstrip()):
        return factory()


def close_jvm(simulator: Any, name: str) -> None:
    """Close a simulator package's object (its JVM may already be gone: nothing left to release), then disarm its
    ``close``: the object's ``__del__`` would call it again on the dead gateway."""
    try:
        simulator.close()
    except Exception as exc:
        logging.getLogger(__name__).debug("%s JVM shutdown: %s", name, exc)
    simulator.close = lambda: None


def extract_action(response: str) -> tuple[str | None, bool]:
    """``(action, well_formed)`` of a raw policy reply, the rule every environment reads actions by. ``action``: the
    first non-empty line (stripped) of the first ``<action>`` tag's text, which ends at ``</action>`` or (a reply cut
    at the token limit) the end; "" for an empty tag; None without a tag (each environment decides what that means).
    ``well_formed``: at most one ``<action>`` tag, and it is closed. Tags are case-insensitive."""
    opens = list(_OPEN_TAG.finditer(response))
    if not opens:
        return None, True
    start = opens[0].end()
    close = _CLOSE_TAG.search(response, start)
    text = response[start:close.start() if close else len(response)]
    action = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return action, len(opens) == 1 and close is not None


def read_action(response: str) -> tuple[str, bool]:
    """``extract_action`` for an environment that takes a reply without a tag as a bare command: its first
    non-empty line, stripped ("" when there is none)."""
    action, well_formed = extract_action(response)
    if action is None:
        action = next((line.strip() for line in response.splitlines() if line.strip()), "")
    return action, well_formed


def is_action_reply(text: str, bare_command: re.Pattern | None = None) -> bool:
    """Whether a reply is an action rather than prose (a reflection that is advice or an action:
    ``rollout/tip_action_frac``): it holds an ``<action>`` tag or is one ``Environment.bare_command``."""
    if extract_action(text)[0] is not None:
        return True
    return bare_command is not None and bare_command.fullmatch(text.strip().lower()) is not None


def replay(env, task: dict[str, Any], replies: list[str]) -> dict[str, Any]:
    """Run ``replies`` in ``env`` from ``task``'s reset until the episode ends: a trajectory record
    (``Environment.demonstrations``' format), with per step ``responses`` (as written), ``actions`` (as executed),
    ``observations`` (after it) and ``admissible_actions`` (as prompted at that state; None for the whole record
    when the environment lists none)."""
    observation, info = env.reset(task)
    record = {"task": task, "instruction": info["instruction"], "initial_observation": observation,
              "responses": [], "actions": [], "observations": [], "admissible_actions": [],
              "max_score": float(info.get("max_score", getattr(env, "max_score", 1.0)))}
    for reply in replies:
        record["admissible_actions"].append(info.get("admissible_actions"))
        observation, _, done, truncated, info = env.step(reply)
        record["responses"].append(reply)
        record["actions"].append(info["action"])
        record["observations"].append(observation)
        if done or truncated:
            break
    record["success"], record["score"] = bool(info["success"]), float(info["score"])
    if not any(record["admissible_actions"]):
        record["admissible_actions"] = None
    return record


class Environment:
    """The contract above and the facts and hooks the trainer, memory, warm start and comparisons read.

    Class attributes:
        display_name: the environment's name in tables and figures.
        score_unit: what ``info["score"]`` is measured in ("points" or "score in [0, 1]"), for reports.
        max_score: the best score of an episode (environment units).
        novelty_coef: the default coefficient of the novelty bonus, in score units (``memory.novelty.coef``:
            ScienceWorld 1.0 point, WebShop 0.01 of its [0, 1] score; docs/method.md#count-based-novelty-bonus).
        bare_command: one action of this environment written without ``<action>`` tags (``is_action_reply``), or
            None when the environment reads tagged actions only.

    Task dicts carry ``task_name`` and ``variation`` (the memory's partition ``<task_name>/<variation>``).
    """

    display_name = "environment"
    score_unit = "score in [0, 1]"
    max_score = 1.0
    novelty_coef = 0.01
    bare_command: re.Pattern | None = None
    system_prompt = ""

    def reset(self, task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def step(self, response: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        raise NotImplementedError

    def tasks(self, split: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    @classmethod
    def config_problems(cls, env_cfg: dict[str, Any], training: bool = False) -> list[str]:
        """The settings of the resolved ``env`` config this environment cannot run, one line each naming
        ``env.<key>``, its value and what is expected. Checked at start-up before any model is made
        (``src/config_checks.py``; ``training``: training tasks are needed too) and by the constructor
        (``check_config``), so it must not start a simulator (default: ``max_steps`` an int >= 1 when given)."""
        if "max_steps" not in env_cfg:
            return []
        return count_problem("max_steps", env_cfg["max_steps"], 1, "actions per episode")

    @classmethod
    def worker_bytes(cls, env_cfg: dict[str, Any]) -> int:
        """The memory one environment worker holds, for the start-up check of how many a machine can run (0: not
        known, not checked)."""
        return 0

    @classmethod
    def with_defaults(cls, env_cfg: dict[str, Any]) -> dict[str, Any]:
        """``env_cfg`` completed with the constructor's defaults: the one place an environment's defaults are
        written (the ``env`` group's schema, ``src/config_schema.py``)."""
        import inspect

        params = inspect.signature(cls.__init__).parameters.values()
        return {**{p.name: p.default for p in params if p.default is not p.empty}, **env_cfg}

    @classmethod
    def check_config(cls, env_cfg: dict[str, Any]) -> None:
        """Raise ValueError, one line per bad setting, on what ``config_problems`` finds (the start-up checks)."""
        problems = cls.config_problems(env_cfg)
        if problems:
            raise ValueError("\n".join(problems))

    @classmethod
    def startup_warnings(cls, env_cfg: dict[str, Any]) -> None:
        """Warn at start-up about settings that run but may not do what the user meant (default: nothing)."""

    @classmethod
    def warm_start_config(cls, env_cfg: dict[str, Any], num_tasks: int | None) -> dict[str, Any]:
        """The config the warm start builds its environment from, ``model.warm_start.num_tasks`` given (default:
        the run's own)."""
        return env_cfg

    def warm_start_tasks(self, num_tasks: int | None) -> list[dict[str, Any]]:
        """The training tasks the warm start demonstrates (default: the first ``num_tasks`` of the train split;
        None: all). Never a held-out task."""
        return self.tasks("train")[:num_tasks]

    def demonstrations(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str
                       ) -> list[dict[str, Any]]:
        """Trajectory records (``replay``'s format) that solve ``tasks``, maybe cached in ``data_dir``. Raises
        NotImplementedError when the environment has none (no imitation warm start)."""
        raise NotImplementedError(f"{type(self).__name__} has no demonstrations for the imitation warm start "
                                  "(Environment.demonstrations; set model.warm_start=null)")

    def reflection_records(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str
                           ) -> list[dict[str, Any]]:
        """Trajectory records of ``tasks`` that go right and wrong, to write hindsight tips on. Raises
        NotImplementedError when the environment has none."""
        raise NotImplementedError(f"{type(self).__name__} has no reflection examples (Environment."
                                  "reflection_records; set model.warm_start.reflections=null)")

    def oracle_tips(self, tasks: list[dict[str, Any]], env_cfg: dict[str, Any], data_dir: str) -> list[list[str]]:
        """Tips written from privileged information (a gold path, the goal's attributes), one list of lines per task:
        a **diagnostic** of the adaptation protocol (``eval.oracle_tips``), never shown in training. Raises
        NotImplementedError when the environment has none."""
        raise NotImplementedError(f"{type(self).__name__} has no oracle tips (Environment.oracle_tips)")

    @staticmethod
    def hindsight_tip(record: dict[str, Any]) -> list[str]:
        """The tip on a trajectory record, as sentences in order of importance, from what the agent saw (instruction,
        observations, actions, score), never hidden task data. Raises NotImplementedError when there are none."""
        raise NotImplementedError("this environment writes no hindsight tips (Environment.hindsight_tip; set "
                                  "model.warm_start.reflections=null)")


class JvmEnvironment(Environment):
    """An environment whose simulator (``self._sim``, set with ``self._closed = False``) runs in a JVM of its own."""

    @classmethod
    def worker_bytes(cls, env_cfg: dict[str, Any]) -> int:
        heap = cls.with_defaults(env_cfg)["jvm_heap"]
        return jvm_bytes(heap) + JVM_OVERHEAD if _JVM_SIZE.match(str(heap)) else 0

    def close(self) -> None:
        """Shut the JVM down (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        close_jvm(self._sim, self.display_name)

    def __del__(self) -> None:
        self.close()


def environment_class(env_cfg: dict[str, Any] | str) -> type[Environment]:
    """The ``Environment`` subclass an env config (or its ``_target_``) builds, imported without building it. Raises
    TypeError when the target is not one."""
    import hydra

    target = env_cfg if isinstance(env_cfg, str) else env_cfg["_target_"]
    cls = hydra.utils.get_class(target)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"env._target_={target!r} is not a subclass of src.envs.base.Environment (docs/extending.md)")
    return cls
