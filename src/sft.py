"""Imitation warm start: build (or reuse) the fine-tuned policy an RL run starts from (``src/warm_start.py``).

    python src/sft.py experiment=webshop          # the warm start of `src/train.py experiment=webshop`, which
                                                  # also builds it on first use
"""
from __future__ import annotations

import sys

import hydra
import rootutils
from omegaconf import DictConfig

rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True)
from src.utils.entrypoint import start_run  # noqa: E402 - also registers the config resolvers


@hydra.main(version_base="1.3", config_path="../configs", config_name="sft.yaml")
def main(cfg: DictConfig) -> None:
    start_run(cfg)
    if not cfg.model.get("warm_start"):
        raise ValueError("model.warm_start=null: there is no warm start to build")
    from src.warm_start import ensure_warm_start

    ensure_warm_start(cfg)
    print(f"`python src/train.py {' '.join(sys.argv[1:])}` starts RL from it (same config, same cache entry)")


if __name__ == "__main__":
    main()
