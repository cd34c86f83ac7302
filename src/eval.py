"""Evaluate a policy with the protocols of docs/evaluation.md.

    python src/eval.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt   # the run's own settings, from it
    python src/eval.py experiment=scienceworld ckpt_path=null eval.seeds=[0,1,2]        # the untrained base model
    python src/eval.py ckpt_path=... eval.memory=true                                   # tips at evaluation time
    python src/eval.py experiment=transfer_power_to_paint ckpt_path=... eval.trials=10  # OOD adaptation
    python src/eval.py experiment=scienceworld ckpt_path=null model.policy.name_or_path=agent \
        eval.memory_file=agent/memory                                                   # an exported agent

With a checkpoint, the training run's model, data, env, memory and algorithm settings come from it
(``src/checkpoint_settings.py``); what the command line sets applies on top.

Protocols (``eval.protocol``):

- ``standard`` (the paper's in-distribution, "ID", evaluation): the policy plays ``eval.num_tasks`` tasks of
  ``eval.split`` (test variations / test goals) × ``eval.episodes_per_task`` episodes for every seed of ``eval.seeds``
  at ``eval.temperature`` (0.4), without memory. With ``eval.memory=true`` tips are retrieved into the prompts from the
  memory stored in the checkpoint (read only), or, when the checkpoint has none or ``ckpt_path=null``, from a memory
  built during the evaluation: the episodes then run in rounds of one episode per task, and after each round every
  finished episode's reflection is written (``MemoryCallback.write_tips``), so later rounds can retrieve it.
  ``eval.memory_file`` (a memory exported by ``src/export.py``) is read instead of the checkpoint's (read only).
- ``adaptation`` (the paper's out-of-distribution, "OOD", adaptation; docs/evaluation.md#the-adaptation-protocol): the
  policy plays a new task (``eval.task``, e.g. from the ``transfer_*`` experiments) for ``eval.trials`` + 1 trials of
  all tasks × ``eval.episodes_per_task`` episodes, from an empty memory: trial 0 without retrieval, trial k with the
  tips of trials 0..k-1 (``src/evaluation/protocols.py``). A change of the policy weights' SHA-256 raises.

Every seed starts from the same memory and reseeds all generators (``lightning.seed_everything``) before its
first episode, so a rerun with the same seeds gives identical numbers. The episodes run through
``src.data.rollout.evaluate``, the same code as in-training validation.

Outputs: the summary printed as JSON and written atomically to ``eval.summary_file``
(``${paths.output_dir}/eval_summary.json``), metrics ``eval/*`` (standard) or ``adaptation/*`` (one step per
trial) plus the resolved config in the ``logger`` group (MLflow by default), and the summary as an artifact.
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
    # imported here: environment workers are spawned processes that re-import this module
    from src.evaluation.runner import run_eval
    from src.utils.run_end import no_run_dir_on_refusal

    with no_run_dir_on_refusal():
        run_eval(cfg)


if __name__ == "__main__":
    main()
