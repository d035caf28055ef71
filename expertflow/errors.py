"""The error `wrap`, `unwrap` and `stats` raise when they refuse (re-exported as `expertflow.WrapError`); here, apart
from the runtime, so that the adapters' refusal (`UnsupportedModelError`) can be one without importing it."""

from __future__ import annotations

__all__ = ["WrapError"]


class WrapError(ValueError):
    """`wrap` / `unwrap` refused; the model is unchanged."""
