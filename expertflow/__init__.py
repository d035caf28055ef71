"""expertflow: run Mixture-of-Experts models whose experts do not fit in GPU memory.

The public surface only: ``wrap``, ``unwrap``, ``stats``, ``Config`` and ``WrapError`` (what ``wrap`` / ``unwrap`` /
``stats`` raise when they refuse, bad settings included; a ``ValueError``, and for an unknown keyword also a
``TypeError``; the model is then unchanged). Everything else lives in submodules.
"""

from expertflow.config import Config

__all__ = ["Config", "wrap", "unwrap", "stats", "WrapError", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The runtime imports torch and transformers; keep `import expertflow` cheap until it is used.
    if name in ("wrap", "unwrap", "stats", "WrapError"):
        from expertflow import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'expertflow' has no attribute {name!r}")
