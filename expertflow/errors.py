"""The error `wrap`, `unwrap` and `stats` raise when they refuse (re-exported as `expertflow.WrapError`); here, apart
from the runtime, so that the adapters' refusal (`UnsupportedModelError`) can be one without importing it. Also the
wording shared by the refusals of a model directory that cannot be read."""

from __future__ import annotations

__all__ = ["WrapError", "first_line", "is_bad_model", "unreadable_weights"]


def first_line(exc: BaseException) -> str:
    """An error's first line, for a one-line message (its type's name when it has no text); a first line that ends in a
    colon ("Validation error for field 'x':") goes on with the next."""
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    if not lines:
        return type(exc).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def is_bad_model(exc: BaseException) -> bool:
    """Whether an error from loading a saved model directory says that its config.json or files are not a model's:
    a missing or unreadable file, a value of the wrong type (huggingface_hub's config validation, an error of its
    own), a negative size (torch, when the weights are made). Not memory running out, nor a fault in the model's
    code: those are raised as they are."""
    from huggingface_hub.errors import StrictDataclassError

    if isinstance(exc, RuntimeError):
        return "negative dimension" in str(exc)
    return isinstance(exc, (OSError, ValueError, KeyError, StrictDataclassError))


def unreadable_weights(model_dir: str, exc: BaseException) -> ValueError:
    """The refusal of `--model model_dir` whose weights safetensors cannot read (a download or copy cut short)."""
    return ValueError(f"--model {model_dir}: its weights cannot be read ({first_line(exc)}); a weights file is damaged "
                      "or incomplete: download or save the model again")


class WrapError(ValueError):
    """`wrap` / `unwrap` refused; the model is unchanged."""
