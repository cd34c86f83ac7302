"""Evaluate a policy with the protocols of docs/evaluation.md.

    python src/eval.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt   # the run's own settings, from it
    python src/eval.py experiment=scienceworld ckpt_path=null eval.seeds=[0,1,2]        # the untrained base model
    python src/eval.py ckpt_path=... eval.memory=true                                   # tips at evaluation time
    python src/eval.py experiment=transfer_power_to_paint ckpt_path=... eval.trials=10  # OOD adaptation
    python src/eval.py experiment=scienceworld ckpt_path=null model.policy.name_or_path=agent \
        eval.memory_file=agent/memory                                                   # an exported agent

With a checkpoint, the training run's model, data, env, memory and algorithm settings come from it
(``src/checkpoint_settings.py``); what the command line sets applies on top.

Protocols (``eval.protocol``): ``standard``, the paper's in-distribution evaluation (with ``eval.memory=true``, tips
from the checkpoint's memory, an exported one, or one built during the evaluation), and ``adaptation``, the paper's
out-of-distribution adaptation over ``eval.trials`` + 1 trials from an empty memory. docs/evaluation.md describes
both and the outputs: the summary as JSON in ``eval.summary_file``, and ``eval/*`` or ``adaptation/*`` metrics.
Every seed reseeds all generators before its first episode, so a rerun with the same seeds gives identical numbers.
"""
from __future__ import annotations

import hydra
import rootutils
from omegaconf import DictConfig

rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True)
from src.utils.entrypoint import start_run  # noqa: E402 - also registers the config resolvers


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval.yaml")
def main(cfg: DictConfig) -> None:
    from src.checkpoint_settings import use_checkpoint_settings

    use_checkpoint_settings(cfg)  # the training run's settings, from its checkpoint; the command line's on top
    start_run(cfg)
    from src.evaluation.runner import run_eval
    from src.utils.run_end import no_run_dir_on_refusal

    with no_run_dir_on_refusal():
        run_eval(cfg)


if __name__ == "__main__":
    main()
