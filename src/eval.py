"""Evaluate a policy with the protocols of SPEC §5.

    python src/eval.py experiment=scienceworld ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt
    python src/eval.py experiment=scienceworld ckpt_path=null eval.seeds=[0,1,2]        # the untrained base model
    python src/eval.py experiment=webshop ckpt_path=... eval.memory=true                # tips at evaluation time
    python src/eval.py experiment=transfer_power_to_paint ckpt_path=... eval.trials=10  # OOD adaptation

Protocols (``eval.protocol``):

- ``standard`` (SPEC §5 "ID"): the policy plays ``eval.num_tasks`` tasks of ``eval.split`` (test variations /
  test goals) × ``eval.episodes_per_task`` episodes for every seed of ``eval.seeds`` at ``eval.temperature``
  (0.4), without memory. With ``eval.memory=true`` tips are retrieved into the prompts from the memory stored in
  the checkpoint (read only), or, when the checkpoint has none or ``ckpt_path=null``, from a memory built during
  the evaluation: the episodes then run in rounds of one episode per task, and after each round every finished
  episode's reflection is written (``MemoryCallback.write_tips``), so later rounds can retrieve it.
- ``adaptation`` (SPEC §5 "OOD"): the policy plays a new task (``eval.task``, e.g. from the ``transfer_*``
  experiments) for ``eval.trials`` + 1 trials, each trial = all tasks × ``eval.episodes_per_task`` episodes.
  Trial 0 runs without retrieval (the baseline score); every trial, trial 0 included, then writes its
  reflections, so trial k retrieves the tips of trials 0..k-1. The memory starts empty (a trained memory holds
  no entries for the new task's partitions). No weight is updated: a SHA-256 of all policy weights is taken
  before and after and a change raises.

Every seed starts from the same memory and reseeds all generators (``lightning.seed_everything``) before its
first episode, so a rerun with the same seeds gives identical numbers. The episodes run through
``src.data.rollout_datamodule.evaluate``, the same code as in-training validation.

Outputs: the summary printed as JSON and written atomically to ``eval.summary_file``
(``${paths.output_dir}/eval_summary.json``), metrics ``eval/*`` (standard) or ``adaptation/*`` (one step per
trial) plus the resolved config in the ``logger`` group (MLflow by default), and the summary as an artifact.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

import hydra
import rootutils
from omegaconf import DictConfig, OmegaConf

rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True)
import src  # noqa: E402,F401 - registers the config resolvers (${pid:} in the run directory)

# torch/Lightning are imported inside the functions: environment workers are spawned processes that re-import
# this module, and they should not each load torch.
log = logging.getLogger(__name__)

PROTOCOLS = ("standard", "adaptation")


# --------------------------------------------------------------------------- statistics
def mean_stderr(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean and standard error of the mean of per-episode values, pooled over all episodes of all seeds.

    ``stderr = s / sqrt(n)`` with ``s`` the sample standard deviation (Bessel-corrected, n − 1) of the ``n``
    values; the values are collected with ``torchmetrics.CatMetric`` (which also gathers across processes
    under torch.distributed). Units are those of the values (ScienceWorld points, WebShop [0, 1], success 0/1).

    Returns:
        ``{"mean", "stderr", "n"}``; ``mean`` is None for n = 0 and ``stderr`` None for n < 2 (undefined).
    """
    import torch
    from torchmetrics.aggregation import CatMetric

    metric = CatMetric().set_dtype(torch.float64)
    if len(values):
        metric.update(torch.as_tensor(list(values), dtype=torch.float64))
    x = metric.compute() if len(values) else torch.zeros(0, dtype=torch.float64)
    x = x.reshape(-1)
    n = int(x.numel())
    mean = float(x.mean()) if n else None
    stderr = float(x.std(correction=1) / math.sqrt(n)) if n >= 2 else None
    return {"mean": mean, "stderr": stderr, "n": n}


def best_relative_gain(trial_scores: Sequence[float]) -> float | None:
    """Best relative gain of trials 1..K over trial 0: ``(max_k s_k − s_0) / |s_0|`` (SPEC §5).

    Zero baseline: 0.0 when the best later trial also scores 0 (nothing changed); None (undefined, report the
    absolute gain instead) when ``s_0 = 0`` and the best differs. Negative when every later trial is worse.

    Raises:
        ValueError: fewer than two trial scores.
    """
    if len(trial_scores) < 2:
        raise ValueError(f"need trial 0 and at least one later trial, got {len(trial_scores)} score(s)")
    base, best = float(trial_scores[0]), max(float(s) for s in trial_scores[1:])
    if base == 0.0:
        return 0.0 if best == 0.0 else None
    return (best - base) / abs(base)


def weights_sha256(module) -> str:
    """SHA-256 over every tensor of ``module.state_dict()`` (names, dtypes, shapes and raw bytes, in order)."""
    import torch

    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


# --------------------------------------------------------------------------- config and building
def check_eval_config(ev: DictConfig | dict) -> None:
    """Validate the ``eval`` group before anything heavy is built.

    Raises:
        ValueError: an unknown protocol, empty or non-integer seeds, or counts below 1 — naming the bad value.
    """
    protocol = ev.get("protocol")
    if protocol not in PROTOCOLS:
        raise ValueError(f"eval.protocol={protocol!r}: expected one of {PROTOCOLS}")
    seeds = ev.get("seeds")
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or not seeds \
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"eval.seeds={seeds!r}: expected a non-empty list of ints, e.g. [0, 1, 2]")
    for name in ("episodes_per_task", "trials") + (("num_tasks",) if ev.get("num_tasks") is not None else ()):
        value = ev.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"eval.{name}={value!r}: expected an int >= 1")
    if not float(ev.get("temperature")) > 0:
        raise ValueError(f"eval.temperature={ev.get('temperature')!r}: expected > 0 (sampling)")


def load_checkpoint(module, ckpt_path: str) -> dict[str, Any] | None:
    """Load the policy weights (``policy.*`` keys) of a Lightning checkpoint into ``module.policy``.

    Returns the checkpoint's ``MemoryCallback`` state, or None when it has none (GRPO, ``memory=none``).

    Raises:
        FileNotFoundError: no file at ``ckpt_path``.
        ValueError: no policy weights, or weights that do not fit the configured model (a different ``model=``).
    """
    import torch

    path = Path(hydra.utils.to_absolute_path(str(ckpt_path)))  # relative to the launch dir (hydra.job.chdir)
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no such checkpoint file")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    prefix = "policy."
    state = {k[len(prefix):]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"checkpoint {ckpt_path!r} holds no 'policy.*' weights: not a src/train.py checkpoint?")
    try:
        module.policy.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"checkpoint {ckpt_path!r} does not fit the configured model "
                         f"({module.hparams.get('policy', {}).get('name_or_path')!r}); evaluate with the "
                         f"model=... (and LoRA settings) it was trained with. {exc}") from exc
    log.info("Loaded policy weights from %s (global step %s)", ckpt_path, ckpt.get("global_step"))
    return (ckpt.get("callbacks") or {}).get("MemoryCallback")


def _build(cfg: DictConfig) -> dict[str, Any]:
    """Module (checkpoint weights, no reference model), datamodule (rollout settings), Fabric, env config."""
    import lightning as L

    L.seed_everything(cfg.seed, verbose=False)
    algorithm = OmegaConf.to_container(cfg.algorithm, resolve=True)
    # No update happens here, so no frozen reference copy is needed even when the run used a KL term.
    from src.sft import warm_start_model_config

    # Checkpoint weights replace the warm start's, so it is only built/loaded when there is no checkpoint.
    model_cfg, _ = warm_start_model_config(cfg, build=not cfg.get("ckpt_path"))
    module = hydra.utils.instantiate(model_cfg, algorithm={**algorithm, "kl_coef": 0.0})
    module.policy.requires_grad_(False)
    memory_state = load_checkpoint(module, cfg.ckpt_path) if cfg.get("ckpt_path") else None
    # One device, the trainer group's accelerator and precision (autocast under bf16-mixed); no strategy.
    fabric = L.Fabric(accelerator=cfg.trainer.accelerator, devices=1, precision=cfg.trainer.precision)
    module.to(fabric.device)
    datamodule = hydra.utils.instantiate(cfg.data, env=cfg.env, algorithm=cfg.algorithm, _recursive_=False)
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    task = OmegaConf.to_container(cfg.eval, resolve=True).get("task")
    if task is not None:
        env_cfg["task"] = task
    return {"module": module, "memory_state": memory_state, "fabric": fabric, "datamodule": datamodule,
            "env_cfg": env_cfg}


def _build_memory(cfg: DictConfig):
    if not cfg.get("memory") or "_target_" not in cfg.memory:
        raise ValueError("memory-on evaluation (eval.memory=true or eval.protocol=adaptation) needs the memory "
                         "group (memory=empo2); it is memory=none")
    return hydra.utils.instantiate(cfg.memory)


# --------------------------------------------------------------------------- protocols
def _episode_summary(episodes) -> dict[str, Any]:
    from src.data.rollout import episode_metrics

    done = [e for e in episodes if not e.failed]
    metrics = episode_metrics(episodes)
    return {
        "score": mean_stderr([e.score for e in done]),
        "success_rate": mean_stderr([float(e.success) for e in done]),
        "episode_length": metrics.get("episode_length"),
        "invalid_action_rate": metrics.get("invalid_action_rate"),
        "episodes": len(episodes),
        "failed_episodes": len(episodes) - len(done),
    }


def _run_standard(cfg, b, pool, tasks, memory, write_tips: bool) -> dict[str, Any]:
    import lightning as L

    from src.data.rollout_datamodule import evaluate

    ev, module, dm = cfg.eval, b["module"], b["datamodule"]
    rollout_cfg = dm.rollout_config(use_tips=memory is not None, temperature=float(ev.temperature))
    start_state = memory.state_dict() if memory is not None else None
    all_episodes, per_seed, rollout_s = [], [], 0.0
    for seed in ev.seeds:
        L.seed_everything(seed, verbose=False)
        if memory is None:
            metrics, episodes = evaluate(pool, module, tasks, int(ev.episodes_per_task), rollout_cfg,
                                         dm.max_steps, return_episodes=True)
            rollout_s += metrics["rollout_s"]
        else:
            memory.load_state_dict(start_state)
            episodes = []
            for _ in range(int(ev.episodes_per_task)):  # rounds: one episode per task, then its tips
                metrics, round_episodes = evaluate(pool, module, tasks, 1, rollout_cfg, dm.max_steps, memory,
                                                   return_episodes=True)
                rollout_s += metrics["rollout_s"]
                if write_tips:
                    with module.rollout_context():
                        memory.write_tips(round_episodes, module.policy, pool.system_prompt)
                episodes += round_episodes
        seed_summary = _episode_summary(episodes)
        per_seed.append({"seed": seed, "score": seed_summary["score"]["mean"],
                         "success_rate": seed_summary["success_rate"]["mean"], "episodes": len(episodes)})
        log.info("seed %d: score %s, success rate %s", seed, per_seed[-1]["score"], per_seed[-1]["success_rate"])
        all_episodes += episodes
    return {**_episode_summary(all_episodes), "per_seed": per_seed, "rollout_s": rollout_s}


def _run_adaptation(cfg, b, pool, tasks, memory) -> dict[str, Any]:
    import lightning as L

    from src.data.rollout_datamodule import evaluate

    ev, module, dm = cfg.eval, b["module"], b["datamodule"]
    trials = int(ev.trials)
    configs = {use: dm.rollout_config(use_tips=use, temperature=float(ev.temperature)) for use in (False, True)}
    empty = memory.state_dict()
    per_trial: list[list] = [[] for _ in range(trials + 1)]
    memory_sizes = [[] for _ in range(trials + 1)]
    rollout_s = 0.0
    for seed in ev.seeds:
        L.seed_everything(seed, verbose=False)
        memory.load_state_dict(empty)
        for trial in range(trials + 1):
            # trial 0 passes the memory too (no retrieval): its states are embedded so its tips can be written
            metrics, episodes = evaluate(pool, module, tasks, int(ev.episodes_per_task), configs[trial > 0],
                                         dm.max_steps, memory, return_episodes=True)
            rollout_s += metrics["rollout_s"]
            memory_sizes[trial].append(len(memory.tips))
            with module.rollout_context():
                memory.write_tips(episodes, module.policy, pool.system_prompt)
            per_trial[trial] += episodes
            log.info("seed %d trial %d (%s): score %.2f", seed, trial, "tips" if trial else "no memory",
                     _episode_summary(episodes)["score"]["mean"] or math.nan)
    rows = []
    for trial, episodes in enumerate(per_trial):
        s = _episode_summary(episodes)
        rows.append({"trial": trial, "memory": trial > 0, "score": s["score"]["mean"],
                     "score_stderr": s["score"]["stderr"], "success_rate": s["success_rate"]["mean"],
                     "success_rate_stderr": s["success_rate"]["stderr"], "episode_length": s["episode_length"],
                     "episodes": s["episodes"], "failed_episodes": s["failed_episodes"],
                     "memory_size_before": float(sum(memory_sizes[trial]) / len(memory_sizes[trial]))})
    scores = [r["score"] for r in rows]
    if any(s is None for s in scores):
        raise RuntimeError(f"a trial has no finished episode (scores per trial: {scores}); see the worker errors")
    best = max(range(1, trials + 1), key=lambda k: scores[k])
    return {"trials": rows, "trial0_score": scores[0], "best_trial": best, "best_score": scores[best],
            "best_absolute_gain": scores[best] - scores[0], "best_relative_gain": best_relative_gain(scores),
            "rollout_s": rollout_s}


def run_eval(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured protocol; print, save and log the summary; return it.

    Raises:
        ValueError: a bad ``eval`` setting (see ``check_eval_config``), a checkpoint that does not fit the
            model, memory-on evaluation with ``memory=none``, an empty split.
        RuntimeError: the policy weights changed during the evaluation.
    """
    from src.envs.pool import EnvPool
    from src.utils.instantiate import instantiate_loggers
    from src.utils.io import write_text_atomic
    from src.utils.logging import log_config

    ev = cfg.eval
    check_eval_config(ev)
    b = _build(cfg)
    module, fabric = b["module"], b["fabric"]
    adaptation = ev.protocol == "adaptation"
    memory, memory_source, write_tips = None, "none", False
    if adaptation:
        memory, memory_source, write_tips = _build_memory(cfg), "built", True
    elif ev.memory:
        memory = _build_memory(cfg)
        if b["memory_state"] is not None:
            memory.load_state_dict(b["memory_state"])
            memory_source = "checkpoint"
        else:
            memory_source, write_tips = "built", True
    b["datamodule"].memory = memory  # rollout_config reads the memory's tips_scope

    hash_before = weights_sha256(module.policy)
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
        with fabric.autocast():
            result = _run_adaptation(cfg, b, pool, tasks, memory) if adaptation else \
                _run_standard(cfg, b, pool, tasks, memory, write_tips)
        memory_metrics = memory.pop_metrics() if memory is not None else {}
    finally:
        if pool is not None:
            pool.close()
    hash_after = weights_sha256(module.policy)
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
        "memory": memory is not None,
        "memory_source": memory_source,
        "memory_hit_rate": memory_metrics.get("memory/hit_rate"),
        "memory_size": memory_metrics.get("memory/size"),
        **({"trials_k": int(ev.trials)} if adaptation else {}),
        **result,
        "weights_sha256": hash_after,
        "weights_unchanged": True,
    }
    if memory_source == "checkpoint" and not summary["memory_hit_rate"]:
        log.warning("the checkpoint's memory gave no tips on these tasks (partition=%s: the training "
                    "partitions do not cover the evaluation tasks)", memory.partition)
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
        _log_summary(summary, loggers, path)
    return summary


def _log_summary(summary: dict[str, Any], loggers, path: Path) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    def finite(d: dict[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in d.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}

    if summary["protocol"] == "adaptation":
        per_step = [(row["trial"], finite({f"adaptation/{k}": v for k, v in row.items() if k not in ("trial", "memory")}))
                    for row in summary["trials"]]
        final = finite({f"adaptation/{k}": summary[k] for k in ("trial0_score", "best_score", "best_trial",
                                                                  "best_absolute_gain", "best_relative_gain")})
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
            logger.log_metrics(metrics, step=step)
        logger.log_metrics(final, step=len(per_step))
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifact(logger.run_id, str(path))
        logger.save()
        logger.finalize("success")


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval.yaml")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # SIGTERM unwinds like Ctrl-C, so the environment workers and JVMs are shut down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    log.info("Config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    run_eval(cfg)


if __name__ == "__main__":
    main()
