"""RPP, the route-path predictor: from token ids, the likely experts of every token at every MoE layer.

Modules: `model` (the encoder-decoder network), `session` (`RoutePredictor`: files and batch sessions for the
runtime), `data` (traces as per-sequence examples), `train`, `metrics` and `baselines` (batch accuracy, token
recall; prev_step / prev_layer / frequency heuristics), `evaluate` (the `predictor eval` document).
Importing this package imports torch; nothing else happens at import time.
"""

from __future__ import annotations

from pathlib import Path

import torch

from expertflow.predictor.model import PredictorConfig
from expertflow.predictor.session import PredictorSession, RoutePredictor

__all__ = ["RoutePredictor", "PredictorSession", "PredictorConfig", "load_predictor", "default_predictor_path"]


def default_predictor_path() -> Path:
    """The predictor shipped for the built-in tiny MoE (`expertflow.models.tiny_moe()`)."""
    return Path(__file__).resolve().parent.parent / "assets" / "tiny-moe-predictor"


def load_predictor(path: str | Path, device: str | torch.device = "cpu") -> RoutePredictor:
    """Load a trained predictor directory (`config.json` + `model.safetensors`), ready for `new_session()`."""
    return RoutePredictor.load(path, device)
