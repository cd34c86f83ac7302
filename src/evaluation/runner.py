"""One evaluation run: build the policy (checkpoint weights) and memory, run the protocol, write and log the summary."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from src.evaluation.protocols import check_eval_config, run_adaptation, run_standard
from src.evaluation.stats import weights_sha256
from src.utils.checkpoint_loading import read_checkpoint

log = logging.getLogger(__name__)


def load_checkpoint(module, ckpt: dict[str, Any], ckpt_path: str) -> dict[str, Any] | None:
    """Load the policy weights of a checkpoint into ``module.policy`` (``load_policy_weights``); returns the
    checkpoint's ``MemoryCallback`` state, or None when it has none (GRPO).

    Raises:
        ValueError: no policy weights, weights that do not fit the configured model (a different ``model=``), or
            adapters trained on another base model.
    """
    from src.models.checkpoint_state import load_policy_weights

    load_policy_weights(module.policy, ckpt, str(ckpt_path), module.hparams.policy["name_or_path"])
    log.info("Loaded policy weights from %s (global step %s)", ckpt_path, ckpt.get("global_step"))
    return (ckpt.get("callbacks") or {}).get("MemoryCallback")


def _build(cfg: DictConfig) -> dict[str, Any]:
    """Module (checkpoint weights, no reference model), Fabric, env config, the rollout settings of the data group."""
    import lightning as L

    from src.data.rollout_config import RolloutConfig
    from src.models.checkpoint_state import rebuild_policy_config
    from src.warm_start import warm_start_model_config

    L.seed_everything(cfg.seed, verbose=False)
    algorithm = OmegaConf.to_container(cfg.algorithm, resolve=True)
    ckpt = read_checkpoint(cfg.ckpt_path) if cfg.get("ckpt_path") else None
    # Checkpoint weights replace the warm start's, so it is only built/loaded when there is no checkpoint.
    model_cfg, _ = warm_start_model_config(cfg, build=ckpt is None)
    if ckpt is not None:  # an adapter-only checkpoint names its base model
        model_cfg.policy = rebuild_policy_config(ckpt, OmegaConf.to_container(model_cfg.policy))
    # No update happens here, so no frozen reference copy is needed even when the run used a KL term.
    module = hydra.utils.instantiate(model_cfg, algorithm={**algorithm, "kl_coef": 0.0})
    memory_state = load_checkpoint(module, ckpt, cfg.ckpt_path) if ckpt is not None else None
    module.policy.requires_grad_(False)
    fabric = L.Fabric(accelerator=cfg.trainer.accelerator, devices=1, precision=cfg.trainer.precision)
    module.to(fabric.device)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    task = OmegaConf.to_container(cfg.eval, resolve=True).get("task")
    if task is not None:
        env_cfg["task"] = task
    return {"module": module, "memory_state": memory_state, "fabric": fabric, "env_cfg": env_cfg,
            "rollout": RolloutConfig.from_data(data), "max_steps": data.get("max_steps")}


def _build_memory(cfg: DictConfig):
    memory = hydra.utils.get_class(cfg.memory._target_).from_config(cfg.memory, cfg.algorithm.semantics)
    memory.use_environment(OmegaConf.to_container(cfg.env, resolve=True))
    return memory


def run_eval(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured protocol; print, save and log the summary; return it.

    Raises:
        ConfigError: a bad ``eval`` setting (see ``check_eval_config``) or an ``eval.memory_file`` that cannot be
            read, before anything is built.
        ValueError: a checkpoint that does not fit the model, an empty split.
        RuntimeError: the policy weights changed during the evaluation.
    """
    from src.config_checks import check_env_settings
    from src.utils.config_error import refused_settings
    from src.model_checks import check_context_window
    from src.utils.startup_checks import check_checkpoint_path
    from src.models.rollout_engine import resolve_rollout_precision
    from src.utils.precision_choice import resolve_precision

    ev = cfg.eval
    with refused_settings():  # before any model is built
        resolve_precision(cfg)
        resolve_rollout_precision(cfg)
        check_eval_config(ev)
        check_env_settings(cfg.env)
        check_checkpoint_path(cfg)  # complete, intact and finite, before any model is built
        check_context_window(cfg)
        memory_file = _read_memory_file(cfg)
    b = _build(cfg)
    memory, memory_source, write_tips = _eval_memory(cfg, b, memory_file)
    hash_before = weights_sha256(b["module"].policy)
    tasks, result, memory_metrics = _run_protocol(cfg, b, memory, write_tips)
    hash_after = weights_sha256(b["module"].policy)
    if hash_after != hash_before:
        raise RuntimeError(f"policy weights changed during evaluation (sha256 {hash_before} -> {hash_after})")

    summary = {
        "protocol": ev.protocol,
        "ckpt_path": cfg.get("ckpt_path"),
        "model": cfg.model.policy.name_or_path,
        "env": b["env_cfg"].get("_target_"),
        "task": b["env_cfg"].get("task"),
        "split": ev.split,
        "num_tasks": len(tasks),
        "episodes_per_task": int(ev.episodes_per_task),
        "seeds": list(ev.seeds),
        "temperature": float(ev.temperature),
        "precision": str(cfg.trainer.precision),
        "memory": memory is not None,
        "memory_source": memory_source,
        "memory_hit_rate": memory_metrics.get("memory/hit_rate"),
        "memory_size": memory_metrics.get("memory/size"),
        **({"trials_k": int(ev.trials)} if ev.protocol == "adaptation" else {}),
        **result,
        "weights_sha256": hash_after,
        "weights_unchanged": True,
    }
    if memory_source in ("checkpoint", "file") and not summary["memory_hit_rate"]:
        log.warning("the trained memory gave no tips on these tasks (partition=%s: the training "
                    "partitions do not cover the evaluation tasks)", memory.partition)
    _write_and_log(cfg, summary)
    return summary


def _run_protocol(cfg: DictConfig, b: dict[str, Any], memory, write_tips: bool) -> tuple[list[dict], dict, dict]:
    """Run ``eval.protocol`` on the split's tasks: (the tasks, the protocol's result, the memory's metrics).

    Raises:
        ValueError: the split has no tasks.
    """
    from src.envs.pool import EnvPool

    ev = cfg.eval
    adaptation = ev.protocol == "adaptation"
    pool = None
    try:
        # one worker to list the split's tasks, then as many as one batch of concurrent episodes needs
        pool = EnvPool(b["env_cfg"], num_workers=1, timeout_s=float(cfg.data.pool_timeout_s))
        all_tasks = pool.tasks(ev.split)
        tasks = all_tasks[: ev.num_tasks] if ev.num_tasks is not None else all_tasks
        if not tasks:
            raise ValueError(f"eval.split={ev.split!r} has no tasks for env.task={b['env_cfg'].get('task')!r}")
        per_round = 1 if (memory is not None and not adaptation) else int(ev.episodes_per_task)
        pool.resize(len(tasks) * per_round)
        if memory is not None:
            memory.pop_metrics()  # start the hit-rate counters at zero
        fixed_arms = _fixed_arms(cfg, b, tasks) if adaptation else {}
        with b["fabric"].autocast():
            result = run_adaptation(cfg, b, pool, tasks, memory, fixed_arms) if adaptation else \
                run_standard(cfg, b, pool, tasks, memory, write_tips)
        memory_metrics = memory.pop_metrics() if memory is not None else {}
    finally:
        if pool is not None:
            pool.close()
    return tasks, result, memory_metrics


def _read_memory_file(cfg: DictConfig) -> dict[str, Any] | None:
    """The tip state of ``eval.memory_file`` (None without one), read before anything is built. A command line that
    names no ``memory.partition`` takes the file's, set in ``cfg`` (as a checkpoint's settings are taken).

    Raises:
        ValueError: a file of it that cannot be read (named), or a memory stored with another partition setting
            than the one the command line names.
    """
    ev = cfg.eval
    if not ev.get("memory_file"):
        return None
    from hydra.core.hydra_config import HydraConfig

    from src.memory.memory_file import read_memory_files
    from src.checkpoint_settings import command_line_keys

    state, info = read_memory_files(hydra.utils.to_absolute_path(str(ev.memory_file)))
    partition = (cfg.get("memory") or {}).get("partition")
    if partition is not None and info["partition"] != partition and HydraConfig.initialized() \
            and "memory.partition" not in command_line_keys()[0]:
        log.info("memory.partition=%s: the partition eval.memory_file was written with", info["partition"])
        cfg.memory.partition = partition = info["partition"]
    if partition is not None and info["partition"] != partition:
        raise ValueError(f"eval.memory_file={ev.memory_file!r} was written with memory.partition="
                         f"{info['partition']!r}, but memory.partition={partition!r}: its tips would never "
                         f"be retrieved; set memory.partition={info['partition']}")
    return state


def _fixed_arms(cfg: DictConfig, b: dict[str, Any], tasks: list[dict]) -> dict[str, Any]:
    """The diagnostic arms ``eval.oracle_tips`` / ``eval.empty_tips`` ask for (``src/evaluation/fixed_tips.py``).

    Raises:
        ValueError: the environment has no oracle tips.
    """
    from src.evaluation.fixed_tips import empty_tips, oracle_tips, token_lengths

    ev = cfg.eval
    if not (ev.get("oracle_tips") or ev.get("empty_tips")):
        return {}
    data_dir = str((cfg.model.get("warm_start") or {}).get("gold_dir") or cfg.paths.data_dir)
    env = hydra.utils.instantiate(b["env_cfg"])
    try:
        oracle = oracle_tips(env, tasks, b["env_cfg"], data_dir)
    finally:
        env.close()
    tokenizer = b["module"].policy.tokenizer
    arms = {**({"oracle": oracle} if ev.get("oracle_tips") else {}),
            **({"empty": empty_tips(oracle, tokenizer)} if ev.get("empty_tips") else {})}
    for name, arm in arms.items():
        log.info("diagnostic arm %s: %.1f tip tokens per task (e.g. %s)", name, token_lengths(arm, tokenizer),
                 next(iter(arm.tips.values())))
    return arms


def _eval_memory(cfg: DictConfig, b: dict[str, Any], memory_file: dict[str, Any] | None):
    """(memory or None, where it comes from: ``none`` / ``file`` / ``checkpoint`` / ``built``, whether reflections
    are written during the evaluation); the rollouts take its ``tips_scope``.

    Raises:
        ValueError: ``eval.memory_file`` stored with another embedder than the memory group's.
    """
    ev = cfg.eval
    memory, memory_source, write_tips = None, "none", False
    if ev.protocol == "adaptation":
        memory, memory_source, write_tips = _build_memory(cfg), "built", True
    elif memory_file is not None:
        memory, memory_source = _build_memory(cfg), "file"
        memory.tips.load_state_dict(memory_file)
    elif ev.memory:
        memory = _build_memory(cfg)
        if b["memory_state"] is not None:
            memory.load_state_dict(b["memory_state"])
            memory_source = "checkpoint"
        else:
            memory_source, write_tips = "built", True
    if memory is not None:
        b["rollout"] = dataclasses.replace(b["rollout"], tips_scope=memory.tips_scope)
    return memory, memory_source, write_tips


def _write_and_log(cfg: DictConfig, summary: dict[str, Any]) -> None:
    """Print the summary, write it atomically to ``eval.summary_file`` and log it with the ``logger`` group."""
    from src.utils.instantiate import instantiate_loggers
    from src.utils.io import write_text_atomic
    from src.utils.logging import log_config, set_tags

    ev = cfg.eval
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    path = Path(ev.summary_file)
    write_text_atomic(path, text + "\n")
    log.info("Summary written to %s", path)

    logger_cfg = OmegaConf.create(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else {})
    if logger_cfg.get("mlflow"):
        # the logger group names runs like training runs; prefix it so evaluations are told apart in MLflow
        logger_cfg.mlflow.run_name = f"{cfg.task_name}-{ev.protocol}-{logger_cfg.mlflow.run_name}"
    loggers = instantiate_loggers(logger_cfg)
    if loggers:
        log_config(cfg, loggers)
        set_tags(loggers, {"precision_used": summary["precision"],
                           "rollout_precision_used": str(cfg.model.policy.get("rollout_precision"))})
        _log_summary(summary, loggers, path)


def _log_summary(summary: dict[str, Any], loggers, path: Path) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    def finite(d: dict[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}

    if summary["protocol"] == "adaptation":
        per_step = [(t, {}) for t in range(summary["trials_k"] + 1)]
        for key, prefix in (("trials", "adaptation/"), ("control_trials", "adaptation/control_")):
            for row in summary.get(key) or []:  # trials: absent with eval.own_tips=false
                per_step[row["trial"]][1].update(finite({prefix + k: v for k, v in row.items()
                                                         if k not in ("trial", "memory")}))
        for paired in summary.get("paired") or []:
            per_step[paired["trial"]][1].update(finite({
                "adaptation/paired_score_diff": paired["score_diff"]["mean"],
                "adaptation/paired_score_diff_stderr": paired["score_diff"]["stderr"],
                "adaptation/paired_success_diff": paired["success_diff"]["mean"]}))
        final = finite({f"adaptation/{k}": summary[k] for k in ("trial0_score", "best_score", "best_trial",
                                                                  "best_absolute_gain", "best_relative_gain")
                        if k in summary})
    else:
        per_step = []
        final = finite({"eval/score": summary["score"]["mean"], "eval/score_stderr": summary["score"]["stderr"],
                        "eval/success_rate": summary["success_rate"]["mean"],
                        "eval/success_rate_stderr": summary["success_rate"]["stderr"],
                        "eval/episode_length": summary["episode_length"],
                        "eval/invalid_action_rate": summary["invalid_action_rate"],
                        "eval/episodes": summary["episodes"], "eval/failed_episodes": summary["failed_episodes"],
                        "eval/memory_hit_rate": summary["memory_hit_rate"]})
    for logger in loggers:
        for step, metrics in per_step:
            if metrics:
                logger.log_metrics(metrics, step=step)
        logger.log_metrics(final, step=len(per_step))
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifact(logger.run_id, str(path))
        logger.save()
        logger.finalize("success")
