"""`belady-waves`: Belady's furthest-next-need rule, allowed to serve a request in waves — an offline reference for
policies that leave the request model (`lru-layer-waves`, `expertflow` with `waves`).

A demand miss evicts the resident expert needed furthest in the future; when that expert is one of the running
request's own (held until the request ends in the request model), it answers `WAVE` instead: the request computes
what it holds, releases it, and the miss asks again, now free to evict it. `belady` is optimal when every request
fits in the cache and stays pinned; with waves this rule is a reference, not a limit: it does not plan which experts
go in which wave. One layer of 4 experts, 2 slots, steps needing {0, 3}, {1, 2}, {1, 3}, {1, 2}: at step 1 it keeps
expert 1 (needed first at step 2) and evicts 3, then reloads 3 and 2 (6 loads); evicting 1 once computed keeps 3,
which step 2 computes first and gives its slot to 1, so that step 3 finds 1 and 2 (5 loads;
tests/test_policy_plugins.py).

    expertflow simulate --plugin benchmarks/belady_waves.py --policy belady,belady-waves --trace T ...
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from expertflow.policy import WAVE, ExpertKey, register_policy
from expertflow.policy.base import policy_names
from expertflow.policy.belady import _NEVER, BeladyPolicy

NAME = "belady-waves"
PLUGIN_USAGE = "expertflow simulate --plugin benchmarks/belady_waves.py --policy belady,belady-waves --trace T ..."


class BeladyWavesPolicy(BeladyPolicy):
    """Furthest next need first, counting the running request's own experts, which a wave frees."""

    name = NAME

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._own: set[ExpertKey] = set()  # the running request's experts

    def on_request(self, step: int, layer: int, experts: Sequence[int]) -> None:
        self._own = {(layer, e) for e in experts}

    def victim(self, key: ExpertKey, evictable: Callable[[ExpertKey], bool], free_slots: int):
        if free_slots > 0:
            return None
        chosen, held = self._furthest_evictable(evictable)
        own_furthest = max((-neg for neg, k in held if k in self._own), default=-1)
        wave = chosen is not None and own_furthest > self._next.get(chosen, _NEVER)
        if wave:  # the chosen one stays resident
            held.append((-self._next.get(chosen, _NEVER), chosen))
        for entry in held:
            heapq.heappush(self._heap, entry)
        return WAVE if wave else chosen


if NAME not in policy_names():  # imported both by a benchmark and as `--plugin`: register once
    register_policy(BeladyWavesPolicy)


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
