"""Settings that cannot work, refused before anything is built (docs/robustness.md, "Settings refused at start-up").

``prepare_run`` is every start-up check of ``src/train.py``: the Lightning options, the GPU and the checkpoint file
(``src/utils/startup_checks.py``), every setting's value (``check_training_settings``: one ``ConfigError`` listing
each bad key with its value and what is expected; each group's own rules are its schema's, ``Settings.problems``,
and the rules that span groups are here), the checkpoint's (``src/utils/startup_checks.py``) and the model's
(``src/model_checks.py``). Nothing here loads weights or starts an environment.
"""
from __future__ import annotations

import difflib
import inspect
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.utils.config_error import ConfigError
from src.utils.settings import is_int, number


def _container(node: Any) -> dict[str, Any]:
    if node is None:
        return {}
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def trainer_problems(trainer: dict[str, Any]) -> list[str]:
    """Unknown ``trainer.*`` keys (Lightning's ``Trainer`` would raise a TypeError after the model is built) and an
    iteration count below 1."""
    from lightning.pytorch import Trainer

    from src.utils.precision_choice import precision_problems
    from src.utils.startup_checks import hardware_problems

    known = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    problems = []
    for key in sorted(set(trainer) - known - {"_target_", "_partial_", "_recursive_", "_convert_"}):
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean trainer.{close[0]}?" if close else ""
        problems.append(f"trainer.{key}: not an argument of Lightning's Trainer{hint}")
    epochs = trainer.get("max_epochs")
    if epochs is not None and (not is_int(epochs) or (epochs < 1 and epochs != -1)):
        problems.append(f"trainer.max_epochs={epochs!r}: the number of training iterations (one epoch = one "
                        "iteration); expected an int >= 1 (or -1: no limit)")
    problems += precision_problems(trainer)  # src/utils/precision_choice.py
    problems += hardware_problems(trainer)  # src/utils/startup_checks.py
    every = trainer.get("check_val_every_n_epoch")
    if every is not None and (not is_int(every) or every < 1):
        problems.append(f"trainer.check_val_every_n_epoch={every!r}: expected an int >= 1 (validate every N "
                        "iterations), or null with data.val=null")
    return problems


def group_problems(schema, values: Any) -> list[str]:
    """A group's own rules (its ``Settings`` dataclass), one line each."""
    try:
        schema.from_dict(values)
    except (ValueError, TypeError) as err:
        return str(err).splitlines()
    return []


def rank_problems(trainer: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """Ranks with nothing to play: task k of an iteration runs on rank k mod world (``play_groups``), so with fewer
    tasks than ranks some ranks would play no episode, every iteration, while the run looks normal."""
    devices, nodes, tasks = trainer.get("devices"), trainer.get("num_nodes", 1), data.get("tasks_per_iteration")
    if not (is_int(devices) and is_int(nodes) and is_int(tasks)) or tasks < 1:
        return []
    world = devices * nodes
    if world > 1 and tasks < world:
        return [f"data.tasks_per_iteration={tasks} with trainer.devices={devices}"
                + (f" x trainer.num_nodes={nodes}" if nodes != 1 else "")
                + f": {world - tasks} of the {world} ranks would play no episode in any iteration (task k runs on "
                f"rank k mod {world}); expected data.tasks_per_iteration >= {world}, or fewer devices"]
    return []


MAX_SEED = 2**32 - 1


def worker_problems(trainer: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """Enough environment workers for the episodes a rank plays at once (task k runs on rank k mod world,
    ``RolloutDataModule.setup``)."""
    workers, needed = data.get("num_env_workers"), _workers_needed(trainer, data)[0]
    if not (is_int(workers) and needed and 1 <= workers < needed):
        return []
    return [f"data.num_env_workers={workers}: each rank plays {needed} episodes at once (data.tasks_per_iteration="
            f"{data['tasks_per_iteration']} over the ranks x data.group_size={data['group_size']}, or the "
            f"validation's); expected null (as many as needed) or an int >= {needed}"]


def _workers_needed(trainer: dict[str, Any], data: dict[str, Any]) -> tuple[int, int]:
    """(episodes a rank plays at once, ranks on this machine); (0, 1) where the settings are themselves refused."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    tasks, group, val = data.get("tasks_per_iteration"), data.get("group_size"), data.get("val") or {}
    if not all(is_int(v) and v >= 1 for v in (tasks, group)):
        return 0, 1
    ranks = devices if is_int(devices) and devices >= 1 else 1
    world = ranks * (nodes if is_int(nodes) and nodes >= 1 else 1)
    needed = max(math.ceil(tasks / world) * group,
                 math.ceil(int(val.get("num_tasks") or 0) / world) * int(val.get("episodes_per_task") or 0))
    return needed, ranks


def check_machine_holds_the_workers(cfg: DictConfig) -> None:
    """Refuse more environment workers than this machine's memory could hold once each simulator has grown to its cap
    (``Environment.worker_bytes``; the ranks of one machine share it). A check of this machine: ``prepare_run`` runs
    it after the accelerator check, so a GPU config composed on another machine is not measured against this one.

    Raises:
        ValueError: naming the settings, the workers, their memory and the machine's.
    """
    import psutil

    from src.envs.base import environment_class

    trainer, data, env = _container(cfg.get("trainer")), _container(cfg.get("data")), _container(cfg.get("env"))
    needed, ranks = _workers_needed(trainer, data)
    workers = data.get("num_env_workers")
    count, each = (workers if is_int(workers) else needed) * ranks, environment_class(env).worker_bytes(env)
    memory = psutil.virtual_memory().total
    if each and count * each > memory:
        raise ValueError(f"data.tasks_per_iteration={data['tasks_per_iteration']} x data.group_size="
                         f"{data['group_size']} starts {count} environment workers on this machine, up to "
                         f"~{each / 2**30:.1f} GiB each (env.jvm_heap and the simulator's own): "
                         f"{count * each / 2**30:.0f} GiB, but the machine has {memory / 2**30:.0f} GiB; expected at "
                         f"most {max(1, memory // each)} workers here (fewer tasks per iteration, a smaller group or "
                         "more machines)")


def env_problems(env: dict[str, Any]) -> list[str]:
    """The environment's settings, by its own class (``Environment.config_problems``: no simulator is started) and
    against its constructor's arguments (an unknown key would fail in every environment worker)."""
    from src.envs.base import environment_class

    if not env:
        return []
    try:
        cls = environment_class(env)
    except (ImportError, AttributeError, KeyError, TypeError, ValueError) as err:
        return [f"env._target_={env.get('_target_')!r}: {err}"]
    params = inspect.signature(cls.__init__).parameters
    known = {k for k, v in params.items() if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)} - {"self"}
    open_ended = any(v.kind == v.VAR_KEYWORD for v in params.values())
    problems = [] if open_ended else [f"env.{key}: not a setting of {cls.__name__} (expected one of {sorted(known)})"
                                      for key in sorted(set(env) - known) if not key.startswith("_")]
    problems += [f"env.{key}={env[key]!r}: expected true or false" for key, p in params.items()
                 if isinstance(p.default, bool) and key in env and not isinstance(env[key], bool)]
    return problems + cls.config_problems(env, training=True)


def check_env_settings(env: Any) -> None:
    """``env_problems`` as one error, for the entry points that check nothing else of a training config (evaluation).

    Raises:
        ValueError: one line per bad ``env.*`` setting.
    """
    problems = env_problems(_container(env))
    if problems:
        raise ValueError("\n".join(problems))


def uses_memory(cfg: DictConfig) -> bool:
    """``algorithm.use_memory``, the one memory switch (False where the algorithm group itself is refused)."""
    from src.models.algorithm_config import AlgorithmConfig

    try:
        return AlgorithmConfig.from_dict(_container(cfg.get("algorithm"))).use_memory
    except (ValueError, TypeError):
        return False


def algorithm_problems(cfg: DictConfig) -> list[str]:
    """The ``algorithm`` group's own checks (``AlgorithmConfig``), and its fit with the memory switch."""
    from src.models.algorithm_config import AlgorithmConfig

    try:
        algorithm = AlgorithmConfig.from_dict(_container(cfg.get("algorithm")))
    except (ValueError, TypeError) as err:
        return [str(err)]
    problems = []
    if algorithm.name == "grpo" and algorithm.use_memory:
        problems.append("algorithm.use_memory=true with algorithm=grpo: the GRPO baseline has no memory and no "
                        "novelty bonus, and a run named grpo-... would build the memory, write tips and add the bonus "
                        "(a contaminated baseline); use algorithm=empo2, or leave algorithm.use_memory=false")
    if algorithm.memory_rollout_prob > 0 and not algorithm.use_memory:
        problems.append(f"algorithm.memory_rollout_prob={algorithm.memory_rollout_prob:g} (algorithm="
                        f"{algorithm.name}) draws memory rollouts, but algorithm.use_memory=false builds no memory; "
                        "set algorithm.memory_rollout_prob=0 or algorithm.use_memory=true")
    tokens = (cfg.get("data") or {}).get("micro_batch_tokens")
    if algorithm.semantics == "authors" and tokens is not None:
        problems.append(f"data.micro_batch_tokens={tokens} with algorithm.semantics=authors: the authors' loss is a "
                        "token mean per micro-batch of data.micro_batch_size samples, which prefix-tree micro-batches "
                        "would weigh otherwise; set data.micro_batch_tokens=null")
    return problems


def model_problems(model: dict[str, Any]) -> list[str]:
    """The optimizer's learning rate and weight decay, gradient clipping, and the policy's and the warm start's own
    rules."""
    problems = []
    optimizer = model.get("optimizer") or {}
    lr = number(optimizer.get("lr"))
    if lr is None or lr <= 0:
        problems.append(f"model.optimizer.lr={optimizer.get('lr')!r}: expected a learning rate > 0 (1e-6 in the "
                        "paper)")
    decay = number(optimizer.get("weight_decay"))
    if decay is None or decay < 0:
        problems.append(f"model.optimizer.weight_decay={optimizer.get('weight_decay')!r}: expected a number >= 0")
    clip = model.get("gradient_clip_val")
    if clip is not None and (number(clip) is None or number(clip) <= 0):
        problems.append(f"model.gradient_clip_val={clip!r}: expected a max gradient norm > 0, or null (no clipping)")
    from src.models.policy_config import PolicyConfig
    from src.models.warm_start_config import WarmStartConfig

    problems += group_problems(PolicyConfig, model.get("policy"))
    return problems + (group_problems(WarmStartConfig, model["warm_start"]) if model.get("warm_start") else [])


def follower_problems(cfg: DictConfig, found: list[str]) -> list[str]:
    """A setting that follows another one (``follows`` in its schema: ``algorithm.temperature`` is
    ``data.temperature``) set to another value: the log-probs would be taken at another temperature than the one
    sampled, a reply cut at another budget than the one the prompt announced. A follower already in ``found`` (its
    value is wrong in itself) is left to that line."""
    problems = []
    for key, source in followers():
        value, expected = OmegaConf.select(cfg, key), OmegaConf.select(cfg, source)
        known = OmegaConf.select(cfg, source, default="?") != "?"
        if known and value != expected and not any(p.startswith(f"{key}=") for p in found):
            problems.append(f"{key}={value!r} follows {source}={expected!r}; set {source} instead")
    return problems


def followers() -> list[tuple[str, str]]:
    """(a setting, the one it follows) for every plain follower of the schemas."""
    from src.data.rollout_config import DataConfig
    from src.models.algorithm_config import AlgorithmConfig
    from src.models.policy_config import PolicyConfig
    from src.utils.settings import followed

    return [(f"{path}.{name}", source) for path, schema in (("algorithm", AlgorithmConfig), ("data", DataConfig),
                                                             ("model.policy", PolicyConfig))
            for name, source in followed(schema).items()]


def check_training_settings(cfg: DictConfig) -> None:
    """Refuse every setting of a training config that cannot work, naming each key, its value and what is expected.

    Raises:
        ConfigError: one line per bad setting.
    """
    from src.data.rollout_config import DataConfig
    from src.memory.settings import MemoryConfig
    from src.utils.startup_checks import generation_problems

    seed = cfg.get("seed")
    problems = [] if is_int(seed) and seed >= 0 else [
        f"seed={seed!r}: expected an int >= 0 (it seeds every random stream of the run: modes, tasks, tokens)"]
    if is_int(seed) and seed > MAX_SEED:
        problems.append(f"seed={seed}: NumPy and Lightning seed with 32 bits; expected an int <= {MAX_SEED}")
    problems += trainer_problems(_container(cfg.get("trainer")))
    problems += group_problems(DataConfig, _container(cfg.get("data")))
    problems += rank_problems(_container(cfg.get("trainer")), _container(cfg.get("data")))
    problems += env_problems(_container(cfg.get("env")))
    problems += worker_problems(_container(cfg.get("trainer")), _container(cfg.get("data")))
    problems += algorithm_problems(cfg)
    problems += model_problems(_container(cfg.get("model")))
    problems += generation_problems(_container(cfg.get("trainer")), _container(cfg.get("model")))
    problems += group_problems(MemoryConfig, _container(cfg.get("memory")))  # read only with memory; a typo anyway
    problems += follower_problems(cfg, problems)
    for follower, source in followers():  # the follower is ${source}: one line for one mistake
        if any(p.startswith(f"{source}=") for p in problems):
            problems = [p for p in problems if not p.startswith(f"{follower}=")]
    if problems:
        raise ConfigError("\n".join(problems) if len(problems) > 1 else problems[0])


# Settings a resumed run may not change (everything else may: the learning rate, max_epochs, loggers, validation,
# rollout sizes...). "env" stands for every env.* key but env.max_steps.
FIXED_ON_RESUME = ("algorithm.name", "algorithm.use_memory", "env", "model.policy.name_or_path",
                   "model.policy.lora.enabled", "memory.partition", "memory.key", "memory.embedder.name_or_path")


def resolved_config(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` as plain objects, interpolations resolved (unresolved where only Hydra's runtime can resolve them: a
    config a test composed)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:
        return OmegaConf.to_container(cfg, resolve=False)


def _fixed(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FIXED_ON_RESUME) and key != "env.max_steps"


def check_resume_settings(cfg: DictConfig, path: Path) -> dict[str, tuple[Any, Any]]:
    """Compare the config of a resumed run with the one its checkpoint was trained with (``RUN_CONFIG_KEY``;
    nothing to compare in a checkpoint written before it was saved). Returns the settings that changed and may change,
    ``{key: (checkpoint value, new value)}``, for the log and the tracker (``resumed/<key>``).

    Raises:
        ValueError: a ``FIXED_ON_RESUME`` setting changed, naming each key with both values.
    """
    from src.checkpoint_settings import flat, saved_run_config

    saved = saved_run_config(path)
    if not saved:
        return {}
    before, after = flat(saved), flat(resolved_config(cfg))
    skip = ("ckpt_path", "paths.", "hydra.", "trainer.default_root_dir", "logger.",
            "callbacks.model_checkpoint.dirpath")
    changed = {k: (before[k], after.get(k)) for k in sorted(before)
               if not k.startswith(skip) and k in after and before[k] != after[k]}
    fixed = [f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in changed.items() if _fixed(k)]
    if fixed:
        raise ValueError(f"ckpt_path={str(cfg.ckpt_path)!r} was trained with other settings than a resumed run may "
                         f"change ({'; '.join(fixed)}): resume with the checkpoint's values, or leave ckpt_path unset "
                         "to start a new run")
    return {k: v for k, v in changed.items() if not _fixed(k)}


def prepare_run(cfg: DictConfig) -> dict[str, tuple[Any, Any]]:
    """All start-up checks of a training config, in order (``cfg`` may be changed: see ``check_trainer_options``):
    Lightning options, the accelerator, every setting's value, the checkpoint to resume (intact, its settings, model
    and iterations left), the tracker; then stale checkpoint temp files are removed. Returns the settings a resume
    changes (``check_resume_settings``; {} for a new run). Raises ValueError, OSError: the first check that fails."""
    from src.model_checks import check_checkpoint_model, check_context_window
    from src.utils.startup_checks import (check_accelerator, check_checkpoint_path, check_resume_trains,
                                          check_trainer_options, clean_checkpoint_dirs)
    from src.utils.tracker_checks import check_tracker

    check_trainer_options(cfg)
    check_accelerator(cfg)  # first: on a machine without the GPU the config names, the settings' sizes do not apply
    check_training_settings(cfg)
    check_machine_holds_the_workers(cfg)
    check_context_window(cfg)
    path = check_checkpoint_path(cfg)
    changes = check_resume_settings(cfg, path) if path is not None else {}
    if path is not None and cfg.get("model") is not None:
        check_checkpoint_model(cfg, path)
        check_resume_trains(cfg, path)
    check_tracker(cfg)
    clean_checkpoint_dirs(cfg)
    return changes
