"""Counters and smaller live-path behaviours, each checked against an independent expectation: the order of the CPU
copy queues, live prefetch/waste/eviction counts, per-layer sums, snapshots and reset, the hand-off order, the copy
thread's lifetime, and transformers' `eager` experts path."""

from __future__ import annotations

import copy
import pickle
import threading
import time

import pytest
import torch

import expertflow
import expertflow.runtime
from expertflow.cache import ExpertCache
from expertflow.counters import Stats
from expertflow.policy import make_policy
from expertflow.store import ExpertLayout, ExpertStore
from expertflow.transfer import HIGH, LOW, CpuTransferEngine
from families import batch, forward_wrapped, generate_wrapped, make_tiny

N = 1 << 12


def _cache(slots, policy="lru", layers=2, experts=4, bytes_per_s=None, stats=None):
    layout = ExpertLayout.from_tensors([("w", (N,), torch.float32)])
    store = ExpertStore(layout.nbytes)
    for layer in range(layers):
        store.add_layer(layout, [{"w": torch.full((N,), float(100 * layer + e))} for e in range(experts)])
    return ExpertCache(store, slots, make_policy(policy, slots, layers, experts), torch.device("cpu"),
                       CpuTransferEngine(bytes_per_s), Stats() if stats is None else stats)


def test_cpu_engine_runs_a_queued_demand_before_a_queued_prefetch():
    engine = CpuTransferEngine(bytes_per_s=4 / 0.1)  # a 4-byte copy occupies the link for 100 ms
    try:
        def copy(priority):
            return engine.submit(torch.ones(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8), priority)

        copy(LOW)  # occupies the link
        low, high = copy(LOW), copy(HIGH)  # both queued behind it
        high.wait()
        assert low.state != "done", "a queued prefetch ran before a queued demand copy"
        low.wait()
    finally:
        engine.close()


def test_live_prefetch_hit_and_wasted_prefetch_are_counted():
    cache = _cache(2, policy="lookahead")
    try:
        assert cache.prefetch([(1, 0), (1, 1)]) == 2
        for _ in cache.request(0, 1, [0]):  # uses (1, 0)
            pass
        for _ in cache.request(1, 0, [2]):  # evicts the unused (1, 1)
            pass
        s = cache.stats
        assert (s.prefetches, s.prefetch_hits, s.wasted_prefetches) == (2, 1, 1)
        assert (s.loads, s.on_demand_loads, s.evictions) == (3, 1, 1)
    finally:
        cache.engine.close()


def test_handed_off_expert_is_yielded_first_and_alone():
    from expertflow.policy.lru import LRUPolicy

    class NewestFirst(LRUPolicy):
        name = "newest-first-handoff-test"

        def __init__(self, *a):
            super().__init__(*a)
            self.inserted = []

        def on_insert(self, key):
            super().on_insert(key)
            self.inserted.append(key)

        def on_evict(self, key):
            super().on_evict(key)
            self.inserted.remove(key)

        def victim(self, key, evictable, free_slots):
            return None if free_slots else next((k for k in reversed(self.inserted) if evictable(k)), None)

        def prefetches(self, step, layer):
            return [(1, 0)] if (step, layer) == (1, 1) else []

    layout = ExpertLayout.from_tensors([("w", (N,), torch.float32)])
    store = ExpertStore(layout.nbytes)
    for layer in range(2):
        store.add_layer(layout, [{"w": torch.full((N,), float(100 * layer + e))} for e in range(4)])
    cache = ExpertCache(store, 2, NewestFirst(2, 2, 4), torch.device("cpu"), CpuTransferEngine(), Stats())
    try:
        for _ in cache.request(0, 0, [0, 1]):
            pass
        parts = [[e for e, _ in part] for part in cache.request(1, 0, [0, 1], upcoming=(1, 1))]
        assert parts == [[1], [0]], parts  # expert 1's slot went to the prefetch: computed first, alone
    finally:
        cache.engine.close()


@pytest.mark.parametrize("slots", [1, 4, 16])
def test_live_counters_agree(slots):
    model = make_tiny("mixtral")
    _, s = generate_wrapped(model, batch("mixtral"), dict(max_new_tokens=6, min_new_tokens=6, do_sample=False),
                            cache_slots=slots, device="cpu")
    d = s.as_dict()
    assert d["hit_rate"] == pytest.approx(s.hits / s.needs)
    assert sum(p.hits for p in s.per_layer) == s.hits and sum(p.misses for p in s.per_layer) == s.misses
    assert sum(p.loads for p in s.per_layer) == s.loads
    assert s.evictions == max(0, s.loads - slots)  # demand only: the cache fills, then every load evicts


def test_snapshot_is_deep_and_reset_zeroes_every_counter():
    model = make_tiny("mixtral")
    inputs, gen = batch("mixtral"), dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    expertflow.wrap(model, cache_slots=4, device="cpu")
    try:
        model.generate(**inputs, **gen)
        s = expertflow.stats(model)
        snap = s.copy()
        model.generate(**inputs, **gen)
        assert sum(p.needs for p in snap.per_layer) == snap.needs < s.needs
        s.reset()
        assert s.needs == s.hits == s.loads == 0 and all(p.needs == 0 for p in s.per_layer)
        model.generate(**inputs, **gen)
        assert s.needs == snap.needs  # same prompts, same routes: the same needs as the first run
    finally:
        expertflow.unwrap(model)


def test_link_busy_time_is_read_live_from_its_clock_and_reset_from_there():
    untimed = Stats()
    assert untimed.link_busy_s is None and untimed.as_dict()["link_busy_s"] is None
    untimed.reset()
    assert untimed.link_busy_s is None, "a link that is not timed stays so after a reset"
    clock = [2.0]
    timed = Stats()
    timed.time_link(lambda: clock[0])
    assert timed.link_busy_s == 0.0, "only what the link does from now on counts"
    clock[0] = 2.5
    snap = timed.copy()
    clock[0] = 3.25
    assert timed.link_busy_s == 1.25 and snap.link_busy_s == 0.5, "the snapshot keeps its value"
    timed.reset()
    snap.reset()
    assert timed.link_busy_s == 0.0 and snap.link_busy_s == 0.0
    clock[0] = 4.0
    assert timed.link_busy_s == 0.75 and snap.link_busy_s == 0.0


def test_the_running_copy_counts_at_most_its_link_time_while_the_thread_wakes_late():
    """Between a copy's end on the emulated link and the moment its thread, woken late, counts it, the link is not
    busy: a read then (and a reset's mark taken then, after which reads went below zero) counts the copy's time."""
    engine = CpuTransferEngine(bytes_per_s=4 / 0.05)  # a 4-byte copy occupies the link for 50 ms
    late = []

    class Oversleep:
        def wait(self, seconds):
            threading.Event().wait(seconds + 0.2)
            late.append(engine.busy_time())

        def set(self):
            pass

    engine._closing = Oversleep()
    try:
        engine.submit(torch.zeros(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8), LOW).wait()
    finally:
        engine._closing = threading.Event()
        engine.close()
    assert len(late) == 1 and late[0] == pytest.approx(0.05, abs=0.02), late
    assert engine.busy_time() == pytest.approx(late[0], abs=1e-9), "counted once, as the reads had it"


@pytest.mark.parametrize("freed_by", ["promote", "cancel"])
def test_a_copy_held_behind_a_shut_gate_starts_on_the_link_clock_when_it_is_freed(freed_by):
    """B waits behind a held copy A; freed after the link has idled (promoted past A, or A cancelled), B occupies the
    link for its own copy time from then on, not from when it was submitted (which took no wall time and counted the
    idle gap as busy)."""
    from expertflow.transfer import Gate

    engine = CpuTransferEngine(bytes_per_s=4 / 0.1)  # a 4-byte copy occupies the link for 100 ms
    try:
        held = engine.submit(torch.zeros(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8), LOW, gate=Gate())
        behind = engine.submit(torch.ones(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8), LOW)
        threading.Event().wait(0.5)  # the link idles
        busy, freed = engine.busy_time(), time.perf_counter()
        engine.promote(behind) if freed_by == "promote" else engine.cancel(held)
        waited = behind.wait()
        assert behind.freed_time >= freed
        assert waited >= 0.05, f"the copy took {waited:.3f} s of the 0.1 s its bytes take on the link"
        # 0.1 s, and what scheduling adds; from its submission it would be 0.6 s
        assert engine.busy_time() - busy < 0.4, "the idle time before it was freed was counted as busy"
    finally:
        engine.close()


def test_unwrap_stops_the_copy_thread():
    def count():
        return sum(t.name == "expertflow-copy" and t.is_alive() for t in threading.enumerate())

    model = make_tiny("mixtral")
    before = count()
    expertflow.wrap(model, cache_slots=2, device="cpu")
    assert count() == before + 1
    expertflow.unwrap(model)
    assert count() == before


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_eager_experts_logits_match(family):
    model = make_tiny(family)
    model.set_experts_implementation("eager")
    reference, logits = forward_wrapped(model, batch(family), cache_slots=3, device="cpu")
    assert torch.equal(logits, reference), f"{family}: max difference {(logits - reference).abs().max():.3g}"


def test_as_dict_is_a_plain_copy():
    from expertflow.counters import LayerStats

    s = Stats(needs=4, hits=3, per_layer=[LayerStats(needs=4, hits=3)], slots_per_layer=[[2], [3]])
    d = s.as_dict()
    d["slots_per_layer"][0][0] = 99
    d["per_layer"][0]["hits"] = 0
    assert s.slots_per_layer == [[2], [3]] and s.per_layer[0].hits == 3
    assert d["per_layer"] == [{"needs": 4, "hits": 0, "misses": 0, "loads": 0}] and d["hit_rate"] == 0.75
    assert set(d) >= {"needs", "hits", "stall_s", "slots_per_layer", "on_demand_rate", "async_load_fraction"}


def test_printing_stats_is_short_and_shows_the_rates():
    """`print(expertflow.stats(model))` (the README's first snippet) gives the totals and derived rates on one short
    line, however long the model ran; the fields and `as_dict()` still have the per-layer rows and the history."""
    import dataclasses

    from expertflow.counters import LayerStats

    model = make_tiny("mixtral")
    _, stats = generate_wrapped(model, batch("mixtral"), dict(max_new_tokens=24, do_sample=False), cache_slots=2,
                                device="cpu")
    text = str(stats)
    assert text == repr(stats) and "\n" not in text and len(text) < 500
    assert f"hit_rate={stats.hit_rate:.3f}" in text and f"on_demand_rate={stats.on_demand_rate:.3f}" in text
    assert f"needs={stats.needs}," in text and "link_busy_s=" in text and "slots_per_layer" not in text
    assert len(stats.slots_per_layer) == stats.steps and len(stats.as_dict()["slots_per_layer"]) == stats.steps
    big = Stats(needs=10**9, hits=10**9, per_layer=[LayerStats() for _ in range(32)],
                slots_per_layer=[[8] * 32 for _ in range(4096)])
    assert len(str(big)) < 500 and "layers=32" in str(big)
    names = [f.name for f in dataclasses.fields(Stats)]
    assert names[-2:] == ["per_layer", "slots_per_layer"] and "cancelled_prefetches" in names


def test_stats_pickle_and_deepcopy_as_the_snapshot_copy_gives():
    """A live Stats (lock, link clock, stall collector) and its `copy()` survive pickle and `copy.deepcopy`: both give
    the snapshot `copy()` gives, with a lock of its own and `link_busy_s` frozen."""
    import copy
    import pickle

    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu", link_bandwidth="1GB/s")
    try:
        with torch.no_grad():
            model(**batch("mixtral"))
        live = expertflow.stats(model)
        snapshot = live.copy()
        assert live.needs > 0 and live.link_busy_s > 0 and live.per_layer
        for stats in (live, snapshot):
            for restored in (pickle.loads(pickle.dumps(stats)), copy.deepcopy(stats)):
                assert restored == snapshot and restored.as_dict() == snapshot.as_dict()
                assert restored.per_layer is not stats.per_layer
                restored.add_stall(1.0)  # its own lock
                restored.reset()
                assert restored.link_busy_s == 0.0 and restored.needs == 0 and stats.needs == snapshot.needs
        with torch.no_grad():
            model(**batch("mixtral"))
        assert live.needs > snapshot.needs and pickle.loads(pickle.dumps(live)).needs == live.needs
    finally:
        expertflow.unwrap(model)


def test_async_load_fraction_leaves_out_prefetches_cancelled_before_their_copy():
    s = Stats(loads=10, prefetches=6, cancelled_prefetches=4, prefetch_hits=1, wasted_prefetches=5)
    assert s.async_load_fraction == (6 - 4) / (10 - 4) and s.as_dict()["async_load_fraction"] == 2 / 6
    assert s.loads == 10 and s.prefetch_precision == 1 / 6  # unchanged: a cancelled prefetch was a wrong guess
    assert Stats(loads=3, prefetches=3, cancelled_prefetches=3).async_load_fraction == 0.0  # no copy ran


def test_a_reset_never_shows_a_reader_thread_an_empty_per_layer_list(monkeypatch):
    """The cache indexes `per_layer` by layer while another thread may reset the counters (`stats` is documented as
    safe to use from another thread): at every moment of a reset the rows are there to index."""
    from expertflow import counters

    stats = Stats(per_layer=[counters.LayerStats(needs=3) for _ in range(4)])
    seen = []
    make = counters.LayerStats

    def row(*args, **kwargs):  # runs in the middle of the reset: what would a layer counting now index?
        seen.append(len(stats.per_layer))
        return make(*args, **kwargs)

    monkeypatch.setattr(counters, "LayerStats", row)
    stats.reset()
    assert seen and min(seen) == 4
    assert len(stats.per_layer) == 4 and all(r.needs == 0 for r in stats.per_layer)


class _ResetMidCount(Stats):
    """Stats that, the first time the counting thread sets the counter named by `arm`, have another thread reset them
    right then, in the middle of the cache's counting, and give that reset a moment to land there."""

    def arm(self, name: str) -> None:
        self.watched, self.counter, self.resetter = name, threading.current_thread(), None

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == getattr(self, "watched", None) and threading.current_thread() is self.counter:
            self.watched = None
            self.resetter = threading.Thread(target=self.reset)
            self.resetter.start()
            self.resetter.join(timeout=0.5)


@pytest.mark.parametrize("moment", ["loads", "needs", "wasted_prefetches"])
def test_a_reset_from_another_thread_lands_between_groups_of_related_counts(moment):
    """`reset` may come from another thread while a layer counts: a load (its totals, its layer's row, demand or
    prefetch), an expert that leaves (eviction, waste) and a layer call (needs, hits, misses, per layer) are each
    counted wholly before it or wholly after it, so the identities between the counters hold after it."""
    stats = _ResetMidCount()
    cache = _cache(2, policy="lookahead", stats=stats)
    stats.arm(moment)
    try:
        for _ in cache.request(0, 0, [0]):  # a demand load, then the call's needs
            pass
        assert cache.prefetch([(1, 0), (1, 1)]) == 2
        for _ in cache.request(0, 1, [0]):  # uses (1, 0)
            pass
        for _ in cache.request(1, 0, [2]):  # evicts the unused (1, 1): wasted
            pass
    finally:
        cache.engine.close()
    stats.resetter.join()
    s, slot_bytes = stats, cache.store.slot_bytes
    assert s.resets == 1
    rows = [sum(getattr(p, f) for p in s.per_layer) for f in ("needs", "hits", "misses", "loads")]
    broken = [name for name, holds in [
        ("hits + misses == needs", s.hits + s.misses == s.needs),
        ("per-layer rows add up", rows == [s.needs, s.hits, s.misses, s.loads]),
        ("loads == on_demand_loads + prefetches", s.loads == s.on_demand_loads + s.prefetches),
        # a prefetch whose copy had not started when (1, 1) was evicted is cancelled (on a busy machine): no bytes
        ("bytes_to_device == (loads - cancelled) x slot",
         s.bytes_to_device == (s.loads - s.cancelled_prefetches) * slot_bytes),
        ("wasted_prefetch_bytes == (wasted - cancelled) x slot",
         s.wasted_prefetch_bytes == (s.wasted_prefetches - s.cancelled_prefetches) * slot_bytes),
        ("prefetch_hits + wasted <= prefetches", s.prefetch_hits + s.wasted_prefetches <= s.prefetches)] if not holds]
    assert not broken, f"a reset while {moment} was counted broke: {broken}; {s.as_dict()}"


class _SnapshotMidCount(Stats):
    """Stats that, once armed, the first time the counting thread sets `loads`, have another thread take a snapshot
    right then."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "loads" and getattr(self, "armed", False):
            self.armed, self.snapshots = False, []
            self.taker = threading.Thread(target=lambda: self.snapshots.extend(
                [self.as_dict(), repr(self), copy.deepcopy(self), pickle.loads(pickle.dumps(self)), self.copy()]))
            self.taker.start()
            self.taker.join(timeout=0.5)


def test_a_snapshot_from_another_thread_is_taken_between_groups_of_related_counts():
    stats = _SnapshotMidCount()
    cache = _cache(2, stats=stats)
    stats.armed = True
    try:
        for _ in cache.request(0, 0, [0]):  # a demand load
            pass
    finally:
        cache.engine.close()
    stats.taker.join()
    as_dict, text, deep, pickled, snapshot = stats.snapshots
    for snapshot in (deep, pickled, snapshot):
        assert snapshot.loads == snapshot.on_demand_loads == sum(p.loads for p in snapshot.per_layer)
        assert snapshot.bytes_to_device == snapshot.loads * cache.store.slot_bytes
    assert as_dict["loads"] == as_dict["on_demand_loads"] == sum(p["loads"] for p in as_dict["per_layer"])
    assert "loads=1, on_demand_loads=1," in text


def test_a_snapshot_reads_the_link_time_before_a_reset_can_come_in():
    clock = [0.0]
    stats = Stats()
    stats.time_link(lambda: clock[0])
    clock[0] = 2.5
    stats.loads = stats.on_demand_loads = 10
    lock = stats.lock

    class _ResetOnRelease:
        """The Stats lock; as `copy` leaves it, another thread's reset takes it."""

        def __enter__(self):
            return lock.__enter__()

        def __exit__(self, *exc):
            lock.__exit__(*exc)
            stats.lock = lock
            resetter = threading.Thread(target=stats.reset)
            resetter.start()
            resetter.join()

    stats.lock = _ResetOnRelease()
    snapshot = stats.copy()
    assert stats.resets == 1 and stats.link_busy_s == 0.0
    assert (snapshot.loads, snapshot.link_busy_s) == (10, 2.5)


def test_the_counting_thread_itself_may_read_and_reset_the_counts_mid_group():
    """A signal handler runs on the thread that counts, possibly inside a group of related counts: reading or
    resetting the counts there must not wait for that thread."""

    class _ResetInside(Stats):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "loads" and getattr(self, "armed", False):
                self.armed = False
                self.copy()
                self.reset()

    stats = _ResetInside()
    cache = _cache(2, stats=stats)
    stats.armed = True

    def run():
        for _ in cache.request(0, 0, [0]):
            pass

    counting = threading.Thread(target=run, daemon=True)
    counting.start()
    counting.join(timeout=10)
    cache.engine.close()
    assert not counting.is_alive(), "the counting thread waits for the lock it holds"
    assert stats.resets == 1


class _ResetAtStep(Stats):
    """Stats that, once armed, the first time the forward's thread sets `steps`, have another thread reset them."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "steps" and getattr(self, "armed", False):
            self.armed = False
            self.resetter = threading.Thread(target=self.reset)
            self.resetter.start()
            self.resetter.join(timeout=0.5)


def test_a_reset_from_another_thread_counts_a_step_and_its_tokens_together(monkeypatch):
    monkeypatch.setattr(expertflow.runtime, "Stats", _ResetAtStep)
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        stats = expertflow.stats(model)
        assert isinstance(stats, _ResetAtStep)
        stats.armed = True
        with torch.no_grad():
            model(**inputs)
        stats.resetter.join()
        assert stats.resets == 1
        assert (stats.steps, stats.tokens) in ((0, 0), (1, inputs["input_ids"].numel())), stats
    finally:
        expertflow.unwrap(model)


def test_a_reset_from_another_thread_counts_a_step_and_its_occupancy_row_together(monkeypatch):
    """`slots_per_layer` has a row per step counted: a reset while the step's row is recorded comes before the step's
    count and its row, or after both."""
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    expertflow.wrap(model, cache_slots=2, device="cpu")
    try:
        stats, cache = expertflow.stats(model), model._expertflow_runtime.cache
        record = cache.snapshot_occupancy

        def reset_first(*args, **kwargs):  # another thread resets just as the row is recorded
            resetter = threading.Thread(target=stats.reset)
            resetter.start()
            resetter.join(timeout=0.5)
            record(*args, **kwargs)

        monkeypatch.setattr(cache, "snapshot_occupancy", reset_first)
        with torch.no_grad():
            model(**inputs)
        monkeypatch.undo()
        for _ in range(100):  # the reset waits for the step's group
            if stats.resets:
                break
            threading.Event().wait(0.01)
        assert stats.resets == 1
        assert len(stats.slots_per_layer) == stats.steps, stats
    finally:
        expertflow.unwrap(model)
