"""`lru-layer-waves`: `lru-layer` with every layer held strictly inside its share, the way mixtral-offloading runs a
layer's experts one after another through that layer's own buffers.

`lru-layer` keeps the simulator's request model: all experts of a request stay pinned until it ends, so a request
larger than its layer's share (a prefill, or a decode step at batch 16) borrows slots from other layers and evicts
their experts. This variant answers `WAVE` instead: the request computes the experts it holds, releases them, and
goes on inside its share. That is outside the request model the built-in policies and `belady` are held to — its
loads can be fewer than Belady's there — so it is a plug-in, not a built-in, and the benchmarks report it beside the
baselines rather than among them.

    expertflow simulate --plugin benchmarks/lru_layer_waves.py --policy lru-layer,lru-layer-waves ...
"""

from __future__ import annotations

from collections.abc import Callable

from expertflow.policy import WAVE, ExpertKey, register_policy
from expertflow.policy.base import policy_names
from expertflow.policy.lru import LayerLRUPolicy

NAME = "lru-layer-waves"
PLUGIN_USAGE = "expertflow simulate --plugin benchmarks/lru_layer_waves.py --policy lru-layer,lru-layer-waves ..."


class LayerWavesLRUPolicy(LayerLRUPolicy):
    """Each layer owns `capacity // L` slots (the first `capacity % L` one more) and never holds more: at its share
    it evicts its own least recent expert, or, when all of them serve the running request, asks for a wave. With
    fewer slots than layers (shares of zero) it borrows as `lru-layer` does."""

    name = NAME

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int):
        layer = key[0]
        if self.quota[layer] and self._count[layer] >= self.quota[layer]:
            own = self._oldest(evictable, layer)
            return own if own is not None else WAVE
        return super().victim(key, evictable, free_slots)


if NAME not in policy_names():  # imported both by a benchmark and as `--plugin`: register once
    register_policy(LayerWavesLRUPolicy)


def main(argv: list[str] | None = None) -> None:
    """Run as a script: --help describes the plug-in; anything else ends in one line saying how to load it (exit
    status 2), since it has nothing to run by itself."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=f"A policy plug-in, not a script; load it with: {PLUGIN_USAGE}")
    parser.parse_args(argv)
    parser.error(f"a policy plug-in, not a script; load it with: {PLUGIN_USAGE}")


if __name__ == "__main__":
    main()
