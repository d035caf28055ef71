"""The error `wrap`, `unwrap` and `stats` raise when they refuse (re-exported as `expertflow.WrapError`); here, apart
from the runtime, so that the adapters' refusal (`UnsupportedModelError`) can be one without importing it. Also the
wording shared by the refusals of a model directory that cannot be read."""

from __future__ import annotations

__all__ = ["WrapError", "first_line", "unreadable_weights"]


def first_line(exc: BaseException) -> str:
    """An error's first line, for a one-line message (its type's name when it has no text)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def unreadable_weights(model_dir: str, exc: BaseException) -> ValueError:
    """The refusal of `--model model_dir` whose weights safetensors cannot read (a download or copy cut short)."""
    return ValueError(f"--model {model_dir}: its weights cannot be read ({first_line(exc)}); a weights file is damaged "
                      "or incomplete: download or save the model again")


class WrapError(ValueError):
    """`wrap` / `unwrap` refused; the model is unchanged."""
