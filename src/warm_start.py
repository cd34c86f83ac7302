"""The imitation warm start: fine-tune the policy on demonstrations before RL, built once and cached.

A 135M policy rarely reaches a reward from scratch (the WebShop paper also imitated first, then ran RL), so RL
starts from a policy fine-tuned on demonstrations of the *training* tasks (``src/data/demonstrations.py``) in the RL
run's prompt format (docs/usage.md#imitation-warm-start). The update is ``src/models/sft_module.py``.

The result is cached under ``<data dir>/models/warm_start/<key>/`` with ``sft_info.json`` (what it was trained on,
its loss and held-out scores by the RL run's validation protocol). The key hashes the base model, the settings and
every example's token ids, so any change builds a new entry; concurrent runs wait on a file lock and reuse it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import RichProgressBar
import torch
from omegaconf import DictConfig, OmegaConf

from src.data.demonstrations import build_examples, demonstration_records, make_dataloader
from src.data.rollout_config import RolloutConfig
from src.models.sft_module import ProgressLog, SFTModule, save_policy
from src.utils.io import json_digest, write_json_atomic
from src.utils.logging import flatten, set_tags
from src.utils.precision_choice import resolve_precision
from src.utils.console import CONSOLE
from src.utils.run_end import end_status, end_tracker_runs

log = logging.getLogger(__name__)

# Bump when the training procedure changes in a way the cache key does not see.
WARM_START_FORMAT = 2  # 2: shared prompt prefix computed once per batch (same loss up to rounding)


def _prepare(cfg: DictConfig, ws: dict[str, Any]) -> dict[str, Any]:
    """Base policy, the RL run's rollout settings, the examples and the cache entry they map to."""
    from src.models.policy import build_policy

    policy_cfg = OmegaConf.to_container(cfg.model.policy, resolve=True)
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    rollout = RolloutConfig.from_data(data)
    records, system_prompt = demonstration_records(env_cfg, ws.get("num_tasks"), ws["gold_dir"])
    L.seed_everything(int(ws["seed"]), verbose=False)
    policy = build_policy(**policy_cfg)
    truncated = policy.num_prompts_truncated
    examples = build_examples(policy, records, system_prompt, rollout, data.get("max_steps"))
    if policy.num_prompts_truncated > truncated:
        log.warning("%d demonstration prompts were cut to max_prompt_tokens=%d by Policy.encode",
                    policy.num_prompts_truncated - truncated, policy.max_prompt_tokens)
    too_long = sum(len(e.response_ids) > policy.max_response_tokens for e in examples)
    if too_long:
        log.warning("%d of %d demonstrated replies are longer than max_response_tokens=%d (EOS included); RL "
                    "cuts them", too_long, len(examples), policy.max_response_tokens)
    train = {k: ws[k] for k in ("epochs", "lr", "batch_size", "weight_decay", "gradient_clip_val", "seed")}
    key = {"format": WARM_START_FORMAT, "base_model": policy_cfg["name_or_path"], "dtype": policy_cfg["dtype"],
           "lora": policy_cfg.get("lora"), "precision": str(cfg.trainer.precision), "train": train,
           "examples": json_digest([[e.prompt_ids, e.response_ids] for e in examples], 64)}
    env_name = env_cfg["_target_"].rsplit(".", 1)[-1].removesuffix("Env").lower()
    base_name = Path(str(policy_cfg["name_or_path"]).split(":")[-1]).name
    val = dict(data.get("val") or {})
    held_out = rollout if val.get("temperature") is None else replace(rollout, temperature=float(val["temperature"]))
    protocol = {**val, "seed": int(ws["seed"]), "max_steps": data.get("max_steps"), "env": env_cfg,
                "rollout": asdict(held_out)}
    prep = {"policy": policy, "policy_cfg": policy_cfg, "env_cfg": env_cfg, "rollout": rollout,
            "pool_timeout_s": float(data["pool_timeout_s"]),
            "records": records, "examples": examples, "reflections": [], "tipped": [], "key": key,
            "out_dir": Path(ws["cache_dir"]) / f"{env_name}-{base_name}-{json_digest(key)}", "protocol": protocol}
    if not ws.get("reflections"):
        return prep
    # A second phase, started from the actions-only entry `prep` describes (its key stays as above, so the entries
    # built before the phase existed are reused).
    reflections, tipped = _reflection_examples(cfg, ws, env_cfg, policy, rollout, data.get("max_steps"), records)
    key = {**key, "reflections": {**_reflection_settings(ws["reflections"]),
                                  "examples": json_digest([[e.prompt_ids, e.response_ids] for e in reflections], 64)}}
    if tipped:
        key["reflections"]["tipped_examples"] = json_digest([[e.prompt_ids, e.response_ids] for e in tipped], 64)
    return {**prep, "reflections": reflections, "tipped": tipped, "key": key, "actions_only": prep,
            "out_dir": Path(ws["cache_dir"]) / f"{env_name}-{base_name}-{json_digest(key)}"}


REFLECTION_SETTINGS = ("max_tokens", "continue_last_prompt", "epochs", "lr", "rehearsal")


def _reflection_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``model.warm_start.reflections`` checked: exactly ``REFLECTION_SETTINGS``, ``0 <= rehearsal <= 1``.

    Raises:
        ValueError: a missing or unknown setting, or a value out of range.
    """
    if not set(REFLECTION_SETTINGS) <= set(settings) <= {*REFLECTION_SETTINGS, "show_tips"}:
        raise ValueError(f"model.warm_start.reflections must set {list(REFLECTION_SETTINGS)} (and optionally "
                         f"show_tips), got {sorted(settings)} (configs/warm_start/imitation.yaml shows an example)")
    if not 0.0 <= float(settings["rehearsal"]) <= 1.0 or float(settings["lr"]) <= 0 or int(settings["epochs"]) < 1:
        raise ValueError(f"model.warm_start.reflections: expected 0 <= rehearsal <= 1, lr > 0, epochs >= 1, got "
                         f"{settings}")
    # show_tips enters the cache key only when on, so the entries built before it existed stay valid
    return {k: settings[k] for k in REFLECTION_SETTINGS} | ({"show_tips": True} if settings.get("show_tips") else {})


def _reflection_examples(cfg: DictConfig, ws: dict[str, Any], env_cfg: dict[str, Any], policy, rollout: RolloutConfig,
                         max_steps: int | None, demonstrations: list[dict]) -> tuple[list, list]:
    """Reflection examples (``src/data/reflections.py``) under ``model.warm_start.reflections`` (``max_tokens``,
    ``continue_last_prompt``: the memory's ``tip_max_tokens``, ``reuse_rollout_cache``). Not read from ``memory``,
    so a run without memory (GRPO) builds the same warm start as EMPO²; a memory that differs is warned about.

    Returns (reflection examples, demonstrated steps with tips in the prompt: only with ``show_tips``)."""
    from src.data.reflections import reflection_examples, reflection_records, tipped_demonstrations

    settings = ws["reflections"]
    memory = cfg.get("memory") or {}
    for name, memory_name in (("max_tokens", "tip_max_tokens"), ("continue_last_prompt", "reuse_rollout_cache")):
        if memory and memory_name in memory and memory[memory_name] != settings[name]:
            log.warning("model.warm_start.reflections.%s=%s but memory.%s=%s: the warm start teaches reflections "
                        "under other settings than the memory asks for them", name, settings[name], memory_name,
                        memory[memory_name])
    records, write_tip, system_prompt = reflection_records(env_cfg, ws.get("num_tasks"), ws["gold_dir"])
    examples = reflection_examples(policy, records, system_prompt, rollout, max_steps, write_tip,
                                   int(settings["max_tokens"]),
                                   bool(settings["continue_last_prompt"]))
    log.info("%d reflection examples from %d trajectories (%d end in success)", len(examples), len(records),
             sum(r["success"] for r in records))
    if settings.get("show_tips"):  # the demonstrations again, next to the tips the other trajectories leave
        tipped = tipped_demonstrations(policy, demonstrations, records, write_tip, int(settings["max_tokens"]))
        tipped = build_examples(policy, tipped, system_prompt, replace(rollout, use_tips=True), max_steps)
        log.info("%d demonstrated steps with tips shown in the prompt", len(tipped))
        return examples, tipped
    return examples, []


def _loggers(cfg: DictConfig, name: str) -> list:
    """The run's loggers, renamed for the warm-start run (MLflow run name, CSV sub-directory)."""
    from src.utils.instantiate import instantiate_loggers

    group = OmegaConf.create(OmegaConf.to_container(cfg.get("logger") or {}, resolve=True))
    for conf in group.values():
        if conf is None:
            continue
        if "run_name" in conf:
            conf.run_name = name
        elif "name" in conf:
            conf.name = name
    return instantiate_loggers(group)


def _fit(cfg: DictConfig, ws: dict[str, Any], policy, examples: list, epochs: int, lr: float, loggers: list
         ) -> tuple[float, list[float], str]:
    """Fine-tune ``policy`` in place on ``examples``; returns (final epoch's mean loss, epoch wall times in s,
    the precision Lightning used)."""
    module = SFTModule(policy, lr=lr, weight_decay=float(ws["weight_decay"]),
                       gradient_clip_val=ws["gradient_clip_val"], micro_batch_tokens=ws.get("micro_batch_tokens"))
    # from_pretrained returns eval mode and Lightning keeps it; train mode turns gradient checkpointing on.
    policy.train()
    with tempfile.TemporaryDirectory(prefix="warm_start_") as root:
        trainer = L.Trainer(accelerator=cfg.trainer.accelerator, devices=1, precision=cfg.trainer.precision,
                            max_epochs=epochs, logger=loggers or False, callbacks=[ProgressLog(), RichProgressBar()],
                            enable_checkpointing=False, enable_model_summary=False, log_every_n_steps=1,
                            default_root_dir=root)
        loader = make_dataloader(examples, int(ws["batch_size"]), int(ws["seed"]))
        trainer.fit(module, train_dataloaders=loader)
    if trainer.global_step != len(loader) * epochs:  # e.g. stopped by SIGTERM: never cache that
        raise RuntimeError(f"warm start training stopped after {trainer.global_step} of {len(loader) * epochs} "
                           "steps; nothing was saved")
    loss = float(trainer.callback_metrics.get("train/loss_epoch", float("nan")))
    return loss, module.epoch_times, trainer.precision


def _train(cfg: DictConfig, ws: dict[str, Any], prep: dict[str, Any], loggers: list) -> dict[str, Any]:
    """Fine-tune and save into the cache entry; returns ``sft_info``.

    With reflection examples, a second phase: the actions-only warm start of the same settings (built first if
    missing) on the reflection examples (and ``show_tips``' tipped steps) plus a ``rehearsal`` share of the action
    examples. Trained together from the base model, the reflections pulled the actions (WebShop: the policy stopped
    buying); after the actions, rehearsed, they do not (docs/usage.md#imitation-warm-start).
    """
    examples, policy, epochs, lr, base = prep["examples"], prep["policy"], int(ws["epochs"]), float(ws["lr"]), None
    rehearsal: list = []
    if prep["reflections"]:
        settings = prep["key"]["reflections"]
        base = _ensure(cfg, {**ws, "reflections": None, "eval": False}, prep["actions_only"])["path"]
        policy = _load(prep, base)  # from disk, so a phase 1 built just now and one reused give the same start
        k = round(float(settings["rehearsal"]) * len(examples))
        rehearsal = random.Random(int(ws["seed"])).sample(examples, k)
        examples = prep["reflections"] + prep["tipped"] + rehearsal
        epochs, lr = int(settings["epochs"]), float(settings["lr"])
    prompt_tokens = sum(len(e.prompt_ids) for e in examples)
    log.info("Building the warm start (once) into %s: %d examples (%d reflections, %d actions) from %s, %.0f prompt "
             "tokens on average, %d epoch(s); the time left is logged as it trains", prep["out_dir"], len(examples),
             len(prep["reflections"]), len(examples) - len(prep["reflections"]), base or "the base model",
             prompt_tokens / len(examples), epochs, extra=CONSOLE)
    tic = time.perf_counter()
    loss, epoch_times, precision = _fit(cfg, ws, policy, examples, epochs, lr, loggers)
    info = {"trained_with": prep["key"], "settings": ws, "env": prep["env_cfg"]["_target_"],
            "tasks": [r["task"] for r in prep["records"]], "num_examples": len(examples),
            "num_reflection_examples": len(prep["reflections"]), "num_rehearsal_examples": len(rehearsal),
            "num_tipped_examples": len(prep["tipped"]),
            "started_from": base, "prompt_tokens_mean": prompt_tokens / len(examples),
            "final_train_loss": loss, "epoch_times_s": epoch_times, "train_time_s": time.perf_counter() - tic,
            "precision_used": precision, "heldout": {}}
    save_policy(policy, prep["out_dir"], info)
    return info


def _load(prep: dict[str, Any], path: str):
    from src.models.policy import build_policy

    return build_policy(**{**prep["policy_cfg"], "name_or_path": str(path)})


def _heldout(cfg: DictConfig, prep: dict[str, Any]) -> dict[str, Any]:
    """The warm start's score and success on the held-out tasks, by the RL run's validation protocol."""
    from src.data.rollout import log_episodes, run_episodes
    from src.envs.pool import EnvPool
    from src.evaluation.stats import mean_stderr

    protocol = prep["protocol"]
    policy = _load(prep, prep["out_dir"])
    n = int(protocol["num_tasks"]) * int(protocol["episodes_per_task"])
    L.seed_everything(protocol["seed"], verbose=False)
    fabric = L.Fabric(accelerator=cfg.trainer.accelerator, devices=1, precision=cfg.trainer.precision)
    pool = EnvPool(prep["env_cfg"], num_workers=n, timeout_s=prep["pool_timeout_s"])
    policy.eval()
    tic = time.perf_counter()
    try:
        tasks = [t for t in pool.tasks(protocol["split"])[: int(protocol["num_tasks"])]
                 for _ in range(int(protocol["episodes_per_task"]))]
        with torch.no_grad(), fabric.autocast():
            episodes, _ = run_episodes(pool, policy, tasks, list(range(len(tasks))),
                                       replace(prep["rollout"], temperature=float(protocol["temperature"])), None,
                                       protocol["max_steps"])
    finally:
        pool.close()
    log_episodes(episodes, "held-out")
    done = [e for e in episodes if not e.failed]
    return {"score": mean_stderr([e.score for e in done]),
            "success_rate": mean_stderr([float(e.success) for e in done]),
            "failed_episodes": len(episodes) - len(done), "eval_time_s": time.perf_counter() - tic,
            "protocol": protocol}


def ensure_warm_start(cfg: DictConfig) -> dict[str, Any] | None:
    """Build (once) or reuse the warm start ``cfg.model.warm_start`` describes; None when it is null.

    Returns ``{"path": the cached Hugging Face directory, "info": its sft_info.json, "heldout": the held-out
    result for the current validation protocol (None when ``data.val`` is null or ``warm_start.eval`` false,
    computed and stored when missing)}``.
    """
    ws = cfg.model.get("warm_start")
    if not ws:
        return None
    ws = OmegaConf.to_container(ws, resolve=True)
    resolve_precision(cfg)  # trainer.precision=auto (src/sft.py, tests): this machine's choice
    with _rng_preserved():  # the warm start seeds its own draws; the RL run's random streams stay untouched
        result = _ensure(cfg, ws)
    _print_summary(result)
    return result


def _ensure(cfg: DictConfig, ws: dict[str, Any], prep: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reuse or build the entry ``prep`` (default: ``_prepare(cfg, ws)``) describes, under its file lock."""
    from filelock import FileLock

    prep = prep or _prepare(cfg, ws)
    out_dir, loggers = prep["out_dir"], []
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        try:
            if (out_dir / "sft_info.json").exists():
                log.info("Reusing the warm start %s (built before; sft_info.json holds what it was trained on)",
                         out_dir, extra=CONSOLE)
                info = json.loads((out_dir / "sft_info.json").read_text())
            else:
                loggers = _loggers(cfg, f"warm-start-{out_dir.name}")
                set_tags(loggers, {"host": socket.gethostname(), "pid": str(os.getpid())})  # for end_stale_runs
                info = _train(cfg, ws, prep, loggers)
            heldout, pkey = None, json_digest(prep["protocol"])
            if ws["eval"] and prep["protocol"].get("split"):
                if pkey not in info["heldout"]:
                    info["heldout"][pkey] = _heldout(cfg, prep)
                    write_json_atomic(out_dir / "sft_info.json", info, indent=1, default=str)
                heldout = info["heldout"][pkey]
        except BaseException as err:  # a signal ends the warm-start run KILLED, an error FAILED; never RUNNING
            end_tracker_runs(loggers, end_status(), err if end_status() == "FAILED" else None)
            raise
    result = {"path": str(out_dir), "info": info, "heldout": heldout}
    if loggers:  # the warm-start run's own MLflow/CSV record
        set_tags(loggers, {"precision_used": info.get("precision_used", prep["key"]["precision"])})
    for logger in loggers:
        logger.log_hyperparams(flatten(prep["key"], "warm_start/"))
        logger.log_metrics(warm_start_metrics(result), step=0)
        logger.finalize("success")
    return result


@contextlib.contextmanager
def _rng_preserved():
    """Restore the Python, NumPy and torch generators on exit (``seed_everything`` inside reseeds them all)."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def warm_start_metrics(result: dict[str, Any] | None) -> dict[str, float]:
    """``warm_start/*`` metrics of an ``ensure_warm_start`` result."""
    if not result:
        return {}
    out = {"warm_start/train_loss": result["info"]["final_train_loss"],
           "warm_start/train_time_s": result["info"]["train_time_s"]}
    for name in ("score", "success_rate"):
        stats = (result["heldout"] or {}).get(name) or {}
        if stats.get("mean") is not None:
            out[f"warm_start/{name}"] = stats["mean"]
        if stats.get("stderr") is not None:
            out[f"warm_start/{name}_stderr"] = stats["stderr"]
    return out


def warm_start_model_config(cfg: DictConfig, build: bool = True) -> tuple[DictConfig, dict[str, Any] | None]:
    """(The model config to instantiate, ``ensure_warm_start``'s result): ``model.warm_start`` removed and, with
    ``build`` (not for weights from a checkpoint), the policy's ``name_or_path`` pointing at the warm start."""
    model_cfg = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
    model_cfg.pop("warm_start", None)
    result = ensure_warm_start(cfg) if build else None
    if result is not None:
        model_cfg.policy.name_or_path = result["path"]
    return model_cfg, result


def _print_summary(result: dict[str, Any]) -> None:
    held = result["heldout"]
    if held is None:
        score = "held-out score not measured"
    else:
        s, w = held["score"], held["success_rate"]
        score = (f"held-out score {s['mean']:.3f} ± {s['stderr'] or 0:.3f}, success {w['mean']:.3f} ± "
                 f"{w['stderr'] or 0:.3f} (n={s['n']}, {held['protocol']['split']} split, "
                 f"T={held['protocol']['temperature']}, no memory)")
    print(f"Warm start {result['path']}: {score}", flush=True)
