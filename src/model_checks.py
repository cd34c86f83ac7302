"""Start-up checks of the configured model against what it must hold, read from its ``config.json`` (no weights
loaded): a checkpoint to resume trained on the same model, and prompt + response lengths within its context window
(docs/robustness.md, "Settings refused at start-up")."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig


def _model_config(policy: Any) -> Any | None:
    """The ``config.json`` of the model ``model.policy`` builds (an adapter's base model's), or None where it cannot be
    read here (left to the model builder, which names what is missing)."""
    from src.models.hub import adapter_base_model, load_config, resolve_name_or_path

    try:
        model = resolve_name_or_path(str(policy.get("name_or_path")), str(policy.get("cache_dir", ".")))
        return load_config(adapter_base_model(model) or model)
    except (OSError, ValueError):
        return None


def _checkpoint_shape(state: dict[str, Any]) -> dict[str, int]:
    """Layers, hidden size and vocabulary of a checkpoint's policy, read from its tensors' shapes (memory-mapped, not
    read): every weight of a full checkpoint, the adapters of a LoRA one (no vocabulary there)."""
    layers = {int(m.group(1)) for k in state if (m := re.search(r"\.layers\.(\d+)\.", k))}
    shape = {"layers": len(layers)} if layers else {}
    for key, tensor in state.items():
        if key.endswith("embed_tokens.weight"):
            shape["vocabulary"], shape["hidden size"] = (int(n) for n in tensor.shape)
        elif "hidden size" not in shape and re.search(r"q_proj\.lora_A\.[^.]+\.weight$", key):
            shape["hidden size"] = int(tensor.shape[1])
    return shape


def check_checkpoint_model(cfg: DictConfig, path: Path) -> None:
    """Refuse to resume a checkpoint onto another model: LoRA on one side only, or another number of layers, hidden
    size or vocabulary than the config's ``model.policy`` builds (read from its ``config.json``, no weights).

    Raises:
        ValueError: naming both models, their shapes and the settings to use.
    """
    import torch

    if path.is_dir():  # a distributed checkpoint: its tensors are not read here
        return
    ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    given = str(cfg.ckpt_path)
    name = f"ckpt_path={given!r}" + (f" ({path})" if str(path) != given else "")

    policy = cfg.model.get("policy") or {}
    trained = ((ckpt.get("hyper_parameters") or {}).get("policy") or {}).get("name_or_path", "?")
    lora = bool((policy.get("lora") or {}).get("enabled"))
    with_lora = any(".lora_" in k for k in ckpt["state_dict"])
    if with_lora != lora:
        held = "LoRA adapters" if with_lora else "no LoRA adapters (a full fine-tune)"
        raise ValueError(f"{name} holds {held}, but model.policy.lora.enabled={str(lora).lower()}: resume with "
                         f"model.policy.lora.enabled={str(with_lora).lower()} (the run was trained from {trained!r})")
    config = _model_config(policy)
    if config is None:
        return
    want = {"layers": config.num_hidden_layers, "hidden size": config.hidden_size, "vocabulary": config.vocab_size}
    have = _checkpoint_shape(ckpt["state_dict"])
    if all(have[k] == want[k] for k in have):
        return
    describe = lambda shape: ", ".join(f"{k} {shape[k]}" for k in want if k in shape)  # noqa: E731
    raise ValueError(f"{name} holds a policy with {describe(have)} (trained from model.policy.name_or_path="
                     f"{trained!r}), but this config builds model.policy.name_or_path={policy.get('name_or_path')!r} "
                     f"with {describe(want)}. Resume with the model the run was trained with (its model=... group), "
                     "or leave ckpt_path unset to start a new run.")


def check_context_window(cfg: DictConfig) -> None:
    """Refuse ``model.policy.max_prompt_tokens`` + ``data.max_response_tokens`` beyond the model's context window
    (``max_position_embeddings`` in its ``config.json``): replies that long cannot be decoded (a cap of 10⁶ tokens
    would allocate and decode for hours).

    Raises:
        ValueError: naming both settings, the window and the largest response cap that fits.
    """
    policy = (cfg.get("model") or {}).get("policy") or {}
    prompt, response = policy.get("max_prompt_tokens"), (cfg.get("data") or {}).get("max_response_tokens")
    if not isinstance(prompt, int) or not isinstance(response, int):
        return
    window = getattr(_model_config(policy), "max_position_embeddings", None)
    if window and prompt + response > window:
        raise ValueError(f"data.max_response_tokens={response} with model.policy.max_prompt_tokens={prompt} passes "
                         f"the model's context window of {window} tokens (max_position_embeddings of "
                         f"{policy.get('name_or_path')}); expected data.max_response_tokens <= {window - prompt}")
