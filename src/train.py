"""Train an LLM agent with EMPO² (default) or GRPO (`algorithm=grpo`).

    python src/train.py experiment=scienceworld
    python src/train.py experiment=webshop algorithm=grpo
    python src/train.py experiment=scienceworld ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt  # resume
"""
from __future__ import annotations

import functools
import logging
import os
import socket
from typing import Any

import hydra
import rootutils
from omegaconf import DictConfig

rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True)
from src.utils.console import CONSOLE  # noqa: E402
from src.utils.entrypoint import start_run  # noqa: E402 - also registers the config resolvers

# torch and Lightning are imported inside the functions (src/utils/entrypoint.py says why)
log = logging.getLogger(__name__)


def build(cfg: DictConfig) -> dict[str, Any]:
    """Instantiate module, datamodule, memory callback, callbacks, loggers and Trainer from the config.

    The loggers are made last but the Trainer: a run in the tracker exists only once everything else is built, and
    ends FAILED if the Trainer cannot be made.
    """
    import lightning as L
    from omegaconf import OmegaConf

    from src.config_checks import resolved_config, uses_memory
    from src.data.rollout_config import DataConfig
    from src.data.rollout_datamodule import RolloutDataModule
    from src.models.memory_estimate import check_device_memory
    from src.warm_start import warm_start_model_config
    from src.utils.checkpoint_io import AtomicCheckpointIO
    from src.utils.config_error import refused_settings
    from src.utils.instantiate import instantiate_callbacks, instantiate_loggers
    from src.models.rollout_engine import resolve_rollout_precision
    from src.utils.precision_choice import resolve_precision
    from src.utils.run_end import end_tracker_runs

    with refused_settings():
        resolve_precision(cfg)
        resolve_rollout_precision(cfg)
        check_device_memory(cfg)  # before loading any weights
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    model_cfg, warm_start = warm_start_model_config(cfg)
    log.info("Instantiating model <%s> from %s", cfg.model._target_, model_cfg.policy.name_or_path)
    module = hydra.utils.instantiate(model_cfg, algorithm=OmegaConf.to_container(cfg.algorithm, resolve=True))
    module.run_config = resolved_config(cfg)  # saved with every checkpoint: a resume compares its settings with it
    memory = None
    if uses_memory(cfg):
        if getattr(hydra.utils.get_class(cfg.memory._target_), "diagnostic", False):
            # oracle tips come from hidden task data: a diagnostic of the evaluation only
            raise ValueError(f"memory._target_={cfg.memory._target_!r} is a diagnostic arm of src/eval.py (oracle or "
                             "placeholder tips); training uses the policy's own memory "
                             "(src.callbacks.memory.MemoryCallback)")
        memory = hydra.utils.get_class(cfg.memory._target_).from_config(cfg.memory, cfg.algorithm.semantics)
        memory.use_environment(OmegaConf.to_container(cfg.env, resolve=True))
    datamodule = RolloutDataModule(env=cfg.env, algorithm=cfg.algorithm, data=DataConfig.from_dict(cfg.data))
    # Lightning saves the memory in every checkpoint and logs its tip tables (first: the tables are rollout time)
    callbacks = ([memory] if memory is not None else []) + instantiate_callbacks(cfg.get("callbacks"))
    loggers = instantiate_loggers(cfg.get("logger"))
    # ModelParallelStrategy (FSDP2) writes distributed checkpoints itself and takes no CheckpointIO plugin.
    sharded = "ModelParallelStrategy" in str(cfg.trainer.get("strategy"))
    try:
        trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                                          plugins=None if sharded else [AtomicCheckpointIO()])
    except BaseException:
        end_tracker_runs(loggers, "FAILED")
        raise
    # handed over here: nothing on the data side reaches through the Trainer
    datamodule.attach(policy=module.policy, reference=module.ref_policy, memory=memory,
                      precision=trainer.precision_plugin.forward_context,
                      global_step=functools.partial(getattr, trainer, "global_step"))  # picklable (ddp_spawn)
    return {"module": module, "datamodule": datamodule, "memory": memory, "trainer": trainer, "loggers": loggers,
            "warm_start": warm_start}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit; return the built objects and the final logged metrics.

    Raises:
        ConfigError: a setting that cannot work, before anything is built (``src/config_checks.py``).
    """
    from omegaconf import OmegaConf

    from src.envs.base import environment_class
    from src.utils.config_error import refused_settings
    from src.config_checks import prepare_run

    from src.models.rollout_engine import resolve_rollout_precision
    from src.utils.precision_choice import resolve_precision

    with refused_settings():
        resolve_precision(cfg)  # the precisions first: a resume compares what will run
        resolve_rollout_precision(cfg)
        changes = prepare_run(cfg)
        environment_class(cfg.env).startup_warnings(OmegaConf.to_container(cfg.env, resolve=True))
    from src.warm_start import warm_start_metrics
    from src.utils.logging import log_checkpoint, log_config, machine_description, set_tags
    from lightning.pytorch.utilities import rank_zero_only

    from src.utils.run_end import end_stale_runs, end_status, end_tracker_runs, error_text, last_checkpoint_message

    objs: dict[str, Any] = {}
    ckpt_path = None
    try:
        objs = build(cfg)
        trainer = objs["trainer"]
        log.info("Run directory: %s (train.log, checkpoints/, tips/)", trainer.default_root_dir, extra=CONSOLE)
        if changes:
            log.info("Resumed with other settings than the checkpoint's: %s",
                     "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()), extra=CONSOLE)
        # A user's path is relative to where the command ran, also when hydra.job.chdir=true moved the process.
        ckpt_path = hydra.utils.to_absolute_path(cfg.ckpt_path) if cfg.get("ckpt_path") else None
        if trainer.is_global_zero:
            end_stale_runs(objs["loggers"])
            log_config(cfg, objs["loggers"])
            # host and pid: for end_stale_runs
            set_tags(objs["loggers"], {"precision_used": trainer.precision, "machine": machine_description(),
                                       "rollout_precision_used": str(cfg.model.policy.get("rollout_precision")),
                                       "host": socket.gethostname(), "pid": str(os.getpid()),
                                       **{f"resumed/{k}": f"{old} -> {new}" for k, (old, new) in changes.items()}})
            start = warm_start_metrics(objs["warm_start"])  # the point RL starts from: its held-out score
            for logger in objs["loggers"] if start else []:
                logger.log_metrics(start, step=0)
        trainer.fit(objs["module"], datamodule=objs["datamodule"], ckpt_path=ckpt_path)
    except BaseException as err:
        status = end_status()
        failed = status == "FAILED"
        end_tracker_runs(objs.get("loggers", []), status, err if failed else None)  # never RUNNING; a signal: KILLED
        if rank_zero_only.rank == 0:  # the error in train.log too (Hydra prints it to the console only)
            log.error("Training stopped (%s%s). %s", status, f": {error_text(err)}" if failed else "",
                      last_checkpoint_message(objs.get("trainer"), ckpt_path))
        raise
    ckpt = getattr(trainer.checkpoint_callback, "last_model_path", None) if trainer.checkpoint_callback else None
    if trainer.is_global_zero:
        if cfg.log_checkpoint_artifact:
            log_checkpoint(ckpt, objs["loggers"])
    objs["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    objs["last_checkpoint"] = ckpt
    return objs


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    from src.utils.run_end import no_run_dir_on_refusal

    start_run(cfg)
    with no_run_dir_on_refusal():
        train(cfg)


if __name__ == "__main__":
    main()
