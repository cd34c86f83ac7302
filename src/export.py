"""Export a trained agent: a Hugging Face directory with its memory (docs/export.md).

    python src/export.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt export.out_dir=agents/scienceworld
    python src/export.py ckpt_path=... export.out_dir=... export.adapter_only=true   # LoRA runs

The run's settings come from the checkpoint (``src/checkpoint_settings.py``); what the command line sets applies on
top. Its ``memory/`` is read by ``python src/eval.py ... eval.memory_file=<dir>/memory``.
"""
from __future__ import annotations

import hydra
import rootutils
from omegaconf import DictConfig

rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True)
from src.utils.entrypoint import start_run  # noqa: E402 - also registers the config resolvers


@hydra.main(version_base="1.3", config_path="../configs", config_name="export.yaml")
def main(cfg: DictConfig) -> None:
    from src.checkpoint_settings import use_checkpoint_settings

    use_checkpoint_settings(cfg)  # the training run's settings, from its checkpoint; the command line's on top
    start_run(cfg)
    from src.model_export import run_export
    from src.utils.run_end import no_run_dir_on_refusal

    with no_run_dir_on_refusal():
        run_export(cfg)


if __name__ == "__main__":
    main()
