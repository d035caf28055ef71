"""A researcher's own policy: registered once, it runs live (`wrap(policy=...)`) and in the simulator (Python and
`expertflow simulate --plugin`). A policy that breaks its contract gets an error naming it and the rule, and a policy
whose hook raises leaves the cache as it was: the next `generate` gives the unwrapped model's tokens."""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

import expertflow
from expertflow import sim
from expertflow.policy import Policy, make_policy, register_policy
from expertflow.policy import base as policy_base
from expertflow.policy.base import PolicyError
from expertflow.runtime import runtime_of
from expertflow.trace import Trace
from families import batch, generate_wrapped, make_tiny

GEN = dict(max_new_tokens=6, do_sample=False)


class FIFO(Policy):
    """First in, first out; what the tests break is switched on by class attributes."""

    name = "fifo"
    fail_insert_at = 0  # the n-th on_insert raises (once)
    fail_evict_at = 0  # the n-th on_evict raises (once)
    pinned_victim = False  # choose a pinned expert (one the running request holds)
    prefetch_outside = False  # prefetch an expert id the model does not have (once)

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        super().__init__(capacity, num_layers, num_experts)
        self.order: OrderedDict = OrderedDict()
        self.inserts = self.evicts = 0

    def on_insert(self, key) -> None:
        self.inserts += 1
        if self.inserts == self.fail_insert_at:
            raise RuntimeError("bug in on_insert")
        self.order[key] = None

    def on_evict(self, key) -> None:
        self.evicts += 1
        if self.evicts == self.fail_evict_at:
            raise RuntimeError("bug in on_evict")
        self.order.pop(key, None)

    def victim(self, key, evictable, free_slots):
        if self.pinned_victim and self.order:
            return next(reversed(self.order))  # the newest: pinned by the running request
        if free_slots:
            return None
        return next((k for k in self.order if evictable(k)), None)

    def prefetches(self, step, layer):
        if self.prefetch_outside:
            type(self).prefetch_outside = False
            return [(layer, self.num_experts)]
        return []


@pytest.fixture
def fifo(monkeypatch):
    """`FIFO` registered as "fifo" for one test (the registry is restored after it)."""
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    cls = register_policy(type("FIFO", (FIFO,), {"name": "fifo"}))
    return cls


def _trace() -> Trace:
    rng = np.random.default_rng(0)
    experts = np.stack([[rng.choice(8, 2, replace=False) for _ in range(2)] for _ in range(40)])
    return Trace(experts=experts, num_experts=8, token_ids=np.arange(40), model="toy")


def test_a_registered_policy_runs_live_and_in_the_simulator(fifo):
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    for slots in (1, 3):
        expertflow.wrap(model, cache_slots=slots, policy="fifo", device="cpu")
        try:
            assert torch.equal(model.generate(**inputs, **GEN), reference)
            assert type(runtime_of(model).cache.policy) is fifo
        finally:
            expertflow.unwrap(model)
    result = sim.simulate(_trace(), "fifo", 4)
    assert result.needs == 40 * 2 * 2 and result.loads == result.needs - result.hits


def test_simulate_command_imports_a_plugin(tmp_path, capsys, monkeypatch):
    from expertflow.cli import main

    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    plugin = tmp_path / "my_policies.py"
    plugin.write_text("from tests_fifo import FIFO\nfrom expertflow.policy import register_policy\n"
                      "register_policy(type('FIFO', (FIFO,), {'name': 'fifo'}))\n")
    (tmp_path / "tests_fifo.py").write_text("from test_policy_plugins import FIFO\n")  # a neighbour it imports
    (tmp_path / "broken.py").write_text("def oops(:\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the plug-in's folder joins it for this test only
    _trace().save(tmp_path / "t.safetensors")
    argv = ["simulate", "--trace", str(tmp_path / "t.safetensors"), "--policy", "lru,fifo", "--slots", "4", "--json"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown policy fifo" in err and "your own: --plugin MODULE" in err
    assert main(argv + ["--plugin", str(plugin)]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["policies"]["fifo"]["needs"] == 40 * 2 * 2
    assert main(argv + ["--plugin", "no_such_module"]) == 2
    assert "--plugin no_such_module: cannot import it" in capsys.readouterr().err
    assert main(argv + ["--plugin", str(tmp_path / "broken.py")]) == 2
    err = capsys.readouterr().err
    assert "broken.py: cannot import it (SyntaxError" in err and "Traceback" not in err


WAVES_PLUGIN = Path(__file__).resolve().parents[1] / "benchmarks" / "lru_layer_waves.py"


def _register_plugin(monkeypatch, path) -> None:
    """Import a plug-in for one test (the registry and sys.path are restored after it)."""
    from expertflow.commands import import_plugins

    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    monkeypatch.setattr(sys, "path", list(sys.path))
    import_plugins([str(path)])


@pytest.fixture
def waves(monkeypatch):
    """The `lru-layer-waves` plug-in registered for one test."""
    _register_plugin(monkeypatch, WAVES_PLUGIN)
    return "lru-layer-waves"


@pytest.fixture
def belady_waves(monkeypatch):
    """The `belady-waves` plug-in registered for one test."""
    _register_plugin(monkeypatch, WAVES_PLUGIN.with_name("belady_waves.py"))
    return "belady-waves"


def test_a_policy_can_ask_for_a_wave_and_keep_a_request_inside_a_layers_share(waves):
    # L = 2, E = 4, 4 slots (2 a layer); two identical steps: layer 0 needs [0, 1, 2], layer 1 needs [0].
    trace = Trace(experts=np.array([[[0, 1, 2], [0, -1, -1]]] * 2), num_experts=4)
    # lru-layer pins the whole request, so layer 0 borrows layer 1's slot: step 2 hits all four experts
    borrowed = sim.simulate(trace, "lru-layer", 4)
    assert (borrowed.hits, borrowed.loads) == (4, 4)
    # inside the share: step 1 loads 0, 1 (wave), then 2 over 0; layer 1 loads its 0; step 2 finds 1, 2 and layer
    # 1's 0 resident (3 hits) and loads 0 again (over 1): 5 loads
    for timing in (None, sim.Timing(transfer_ms=3.0, layer_ms=1.0)):
        result = sim.simulate(trace, waves, 4, timing)
        assert (result.hits, result.loads) == (3, 5)


def test_waves_inside_a_share_keep_the_tokens_exact(waves):
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    for slots in (1, 2, 5):  # 1: fewer slots than layers (borrows as lru-layer); 2 and 5: a share of 1 or 2-3
        out, stats = generate_wrapped(model, inputs, GEN, cache_slots=slots, policy=waves, device="cpu")
        assert torch.equal(out, reference), slots
        assert stats.waves > 0


def test_belady_with_waves_gives_up_the_requests_own_expert_before_those_needed_next(belady_waves):
    """L = 2, E = 4, 3 slots. Step 0: layer 0 needs {0}, layer 1 {0, 1}; step 1: layer 0 {1, 2}, layer 1 {0, 1}.
    Step 1's layer 0 first evicts its expert 0 (never needed again); its second miss finds only layer 1's experts
    evictable, both needed by the very next request, while its own expert 1 is never needed again. `belady` must evict
    one of layer 1's (6 loads); `belady-waves` computes expert 1 first and evicts it (5 loads)."""
    trace = Trace(experts=np.array([[[0, -1], [0, 1]], [[1, 2], [0, 1]]]), num_experts=4)
    loads = {name: sim.simulate(trace, name, 3).loads for name in ("belady", "belady-waves")}
    assert loads == {"belady": 6, "belady-waves": 5}
    waved = sim.simulate(trace, "belady-waves", 3, sim.Timing(transfer_ms=3.0, layer_ms=1.0))
    assert (waved.loads, waved.hits) == (5, 2)


def test_belady_with_waves_is_a_reference_not_a_minimum(belady_waves):
    """The example of belady_waves.py: one layer of 4 experts, 2 slots, steps {0, 3}, {1, 2}, {1, 3}, {1, 2}. The
    rule makes 6 loads; a scripted policy that gives step 1's expert 1 up after computing it, and step 2's expert 3
    likewise, makes 5."""
    from expertflow.policy import WAVE, Policy

    class Scripted(Policy):
        name = "scripted"
        answers = [(0, 0), WAVE, (0, 1), WAVE, (0, 3)]  # in order of the calls that find no free slot

        def victim(self, key, evictable, free_slots):
            if free_slots:
                return None
            answer = self.answers.pop(0)
            assert answer is WAVE or evictable(answer)
            return answer

    trace = Trace(experts=np.array([[[0, 3]], [[1, 2]], [[1, 3]], [[1, 2]]]), num_experts=4)
    assert sim.simulate(trace, "belady-waves", 2).loads == 6
    scripted = sim.simulate(trace, Scripted(2, 1, 4), 2)
    assert (scripted.loads, scripted.waves, Scripted.answers) == (5, 2, [])


def _random_routes(rng, max_tokens: int, max_k: int):
    """Routes [tokens, layers, k] of 1-3 layers of 2-6 experts, 2-`max_tokens` tokens, top-1..`max_k` (fewer when a
    layer has fewer experts), and their (tokens, layers, experts)."""
    layers, experts = int(rng.integers(1, 4)), int(rng.integers(2, 7))
    tokens, k = int(rng.integers(2, max_tokens + 1)), int(rng.integers(1, max_k + 1))
    routes = np.stack([[rng.choice(experts, min(k, experts), replace=False) for _ in range(layers)]
                       for _ in range(tokens)])
    return routes, (tokens, layers, experts)


def test_no_policy_in_waves_loads_fewer_than_the_bound(monkeypatch):
    """`loads_lower_bound` holds for policies that answer `WAVE` too (both plug-ins and `expertflow` with waves, fed
    exact routes as predictions), on random traces at every capacity, and the modeled time for the bound with
    waves; the bound is reached on the example of belady_waves.py (see the test above)."""
    _register_plugin(monkeypatch, WAVES_PLUGIN)
    _register_plugin(monkeypatch, WAVES_PLUGIN.with_name("belady_waves.py"))
    timing = sim.Timing(transfer_ms=3.0, layer_ms=1.0, token_ms=0.5)
    rng = np.random.default_rng(11)
    for _ in range(25):
        routes, (tokens, layers, experts) = _random_routes(rng, max_tokens=13, max_k=3)
        trace = Trace(experts=routes.astype(np.int32), num_experts=experts,
                      steps=np.cumsum(rng.integers(0, 2, tokens)).astype(np.int32))
        workload = sim.Workload.from_trace(trace)
        exact = np.zeros((tokens, layers, experts))
        for t, l, j in np.ndindex(routes.shape):
            exact[t, l, routes[t, l, j]] = 1.0
        for capacity in range(1, layers * experts + 1):
            fewest = sim.loads_lower_bound(workload, capacity)
            bound = sim.lower_bound_ms_per_token(workload, capacity, timing, waves=True)
            runs = [sim.simulate(workload, name, capacity, t) for name in ("lru-layer-waves", "belady-waves")
                    for t in (None, timing)]
            for options in ({"waves": True}, {"waves": True, "margin": 8.0, "wave_gap": 2.0, "defer_to_waves": True},
                            {"waves": True, "wave_gap": 2.0, "on_demand_target": 0.05}):
                policy = policy_base.make_policy("expertflow", capacity, layers, experts, **options)
                runs.append(sim.simulate(trace, policy, capacity, timing, predictions=exact))
            for run in runs:
                assert run.loads >= fewest, capacity
                assert run.modeled_ms_per_token is None or run.modeled_ms_per_token >= bound - 1e-9, capacity


def test_belady_with_waves_decides_as_a_plain_scan_of_the_future_does(belady_waves):
    """The plug-in keeps a heap of next needs; a plainly written version of the same rule (scan every resident, look
    its next need up in the future list) must make the same decisions on random traces, some requests larger than
    the cache."""
    from expertflow.policy import WAVE

    heap_class = policy_base.policy_class(belady_waves)

    class Plain(heap_class):
        def victim(self, key, evictable, free_slots):
            if free_slots > 0:
                return None
            nxt = {k: self._next.get(k, 1 << 62) for k in self._resident}
            movable = [k for k in nxt if evictable(k)]
            if not movable:
                return None
            chosen = max(movable, key=lambda k: (nxt[k], [-k[0], -k[1]]))  # furthest; ties: smallest key
            own = [nxt[k] for k in nxt if k in self._own and not evictable(k)]
            return WAVE if own and max(own) > nxt[chosen] else chosen

    rng = np.random.default_rng(7)
    for _ in range(60):
        routes, (tokens, layers, experts) = _random_routes(rng, max_tokens=11, max_k=2)
        trace = Trace(experts=routes.astype(np.int32), num_experts=experts).rebatch(int(rng.integers(1, 4)))
        workload = sim.Workload.from_trace(trace)
        for capacity in range(1, layers * experts + 1):
            results = []
            for cls in (heap_class, Plain):
                policy = cls(capacity, layers, experts, future=workload.future)
                replay = sim._Replay(workload, policy, capacity, None, None)
                result = replay.run()
                results.append((result.loads, result.hits, replay.counts.waves))
            assert results[0] == results[1], (routes.tolist(), capacity)


def test_registration_refuses_a_taken_or_inherited_name_and_a_missing_victim(monkeypatch):
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    make_policy("lru", 2, 1, 4)  # the built-ins are registered
    with pytest.raises(ValueError, match="policy name 'lru' is taken by expertflow.policy.lru.LRUPolicy"):
        register_policy(type("MyLRU", (FIFO,), {"name": "lru"}))
    with pytest.raises(ValueError, match="has no `name` of its own"):
        register_policy(type("Forgot", (FIFO,), {}))
    with pytest.raises(ValueError, match="must override victim"):
        register_policy(type("NoVictim", (Policy,), {"name": "no-victim"}))

    with pytest.raises(ValueError, match=r"policy class TooFew cannot be built as \(capacity, num_layers, "
                                         r"num_experts\) \(too many positional arguments\); its __init__ must take "
                                         "those three first"):
        register_policy(type("TooFew", (FIFO,), {"name": "too-few", "__init__": lambda self, capacity: None}))
    with pytest.raises(ValueError, match=r"cannot be built as \(capacity, num_layers, num_experts, future=\.\.\.\) "
                                         r"\(got an unexpected keyword argument 'future'\); .*and future as a keyword"):
        register_policy(type("NoFuture", (FIFO,), {"name": "no-future", "needs_future": True}))
    assert "too-few" not in policy_base._REGISTRY and "no-future" not in policy_base._REGISTRY

    def oracle_init(self, capacity, num_layers, num_experts, future):  # an oracle's future, required: fine
        FIFO.__init__(self, capacity, num_layers, num_experts)
        self.future = future

    register_policy(type("Oracle", (FIFO,), {"name": "oracle-required-future", "needs_future": True,
                                             "__init__": oracle_init}))
    trace = Trace(experts=np.array([[[0, 1], [2, 3]]] * 3, dtype=np.int32), num_experts=4)
    assert sim.simulate(trace, "oracle-required-future", 4).needs == 12  # 3 tokens x 2 layers x 2 experts
    empty = Trace(experts=np.zeros((0, 2, 2), dtype=np.int32), num_experts=4)  # no tokens: nothing counted
    result = sim.simulate(empty, "lru", 4)
    assert (result.needs, result.hits, result.loads) == (0, 0, 0)
    assert type(make_policy("lru", 2, 1, 4)).__module__ == "expertflow.policy.lru"


def test_a_policy_with_an_option_without_default_runs_live_given_it_and_is_refused_where_it_is_not(registry):
    def init(self, capacity, num_layers, num_experts, depth, *, label="x"):
        FIFO.__init__(self, capacity, num_layers, num_experts)
        self.depth = depth

    register_policy(type("Deep", (FIFO,), {"name": "deep", "__init__": init}))
    model = make_tiny("mixtral")
    reference = model.generate(**batch("mixtral"), **GEN)
    with pytest.raises(TypeError, match=r"policy 'deep' needs the option\(s\) depth, which have no default: give "
                                        "them in policy_options"):
        expertflow.wrap(model, cache_slots=4, policy="deep", device="cpu")
    expertflow.wrap(model, cache_slots=4, policy="deep", policy_options={"depth": 2}, device="cpu")
    try:
        assert runtime_of(model).cache.policy.depth == 2
        assert torch.equal(model.generate(**batch("mixtral"), **GEN), reference)
    finally:
        expertflow.unwrap(model)
    trace = Trace(experts=np.array([[[0, 1], [2, 3]]] * 3, dtype=np.int32), num_experts=8)
    with pytest.raises(ValueError, match=r"policy 'deep' needs the option\(s\) depth, which have no default and "
                                         "which the simulator does not give: give them defaults to simulate it"):
        sim.simulate(trace, "deep", 4)


def test_an_oracle_or_unknown_policy_is_refused_live_with_the_way_to_register():
    with pytest.raises(ValueError, match="runs only in the simulator"):
        expertflow.Config(policy="belady")
    with pytest.raises(ValueError, match="register your own with @expertflow.policy.register_policy"):
        expertflow.Config(policy="fifo")


# with 12 slots the failing insert takes a free slot; with one, it replaces a victim the policy had let go
@pytest.mark.parametrize("hook, slots", [("fail_insert_at", 12), ("fail_evict_at", 12), ("fail_insert_at", 1)])
def test_a_hook_that_raises_leaves_no_expert_without_its_bytes_and_no_slot_lost(fifo, hook, slots):
    from transformers import AutoTokenizer

    from expertflow.models import tiny_moe

    model = tiny_moe(dtype=torch.float32).eval()  # trained: wrong expert bytes change its tokens
    inputs = dict(AutoTokenizer.from_pretrained(model.name_or_path)(["The quick brown fox"], return_tensors="pt"))
    gen = dict(max_new_tokens=10, do_sample=False)
    reference = model.generate(**inputs, **gen)
    setattr(fifo, hook, 5)
    expertflow.wrap(model, cache_slots=slots, policy="fifo", device="cpu")
    try:
        with pytest.raises(RuntimeError, match="bug in on_"):
            model.generate(**inputs, **gen)
        table = runtime_of(model).cache.table
        assert len(table.residents()) + table.free_slots == table.capacity, "a slot was lost"
        for _ in range(2):
            assert torch.equal(model.generate(**inputs, **gen), reference)
    finally:
        expertflow.unwrap(model)



@pytest.mark.parametrize("capacity", [1, 2])
def test_a_hook_that_raises_while_a_request_pins_its_residents_leaves_no_pin(capacity):
    from expertflow.policy.lru import LRUPolicy
    from expertflow.slots import SlotTable, serve_request

    class Flaky(LRUPolicy):
        fail = False

        def on_access(self, key):
            if self.fail and key == (0, 2):
                raise KeyboardInterrupt
            super().on_access(key)

    policy = Flaky(capacity, 1, 4)
    table = SlotTable(capacity, policy)
    load = lambda key, slot, evicted, *busy: table.mark_ready(key)  # noqa: E731
    for _ in serve_request(table, 0, 0, [1], load):
        pass
    policy.fail = True
    with pytest.raises(KeyboardInterrupt):
        for _ in serve_request(table, 1, 0, [1, 2], load):  # (0, 1) is pinned before (0, 2)'s hook raises
            pass
    assert not table.pinned((0, 1))
    policy.fail = False
    for expert in (0, 3):  # the cache still turns over: (0, 1) can be evicted
        for _ in serve_request(table, 2, 0, [expert], load):
            pass
    assert (0, 1) not in table.residents()


def test_a_policy_that_only_cancels_is_asked_live_as_in_the_simulator(fifo):
    asked = []
    fifo.cancellations = lambda self: asked.append(1) or []  # no on_route of its own
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=3, policy="fifo", device="cpu")
    try:
        model.generate(**batch("mixtral"), **GEN)
        assert len(asked) == expertflow.stats(model).steps * 2  # after each of the two layers' routing
    finally:
        expertflow.unwrap(model)

def test_a_pinned_victim_is_a_policy_error_live_and_simulated(fifo):
    fifo.pinned_victim = True
    with pytest.raises(PolicyError, match="policy 'fifo' chose .* but it is pinned by the running request"):
        sim.simulate(_trace(), "fifo", 2)
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=2, policy="fifo", device="cpu")
    try:
        with pytest.raises(PolicyError, match="victim\\(\\) must return a key for which evictable"):
            model.generate(**batch("mixtral"), **GEN)
    finally:
        expertflow.unwrap(model)


def _refused_live_and_simulated(name: str, slots: int, message: str) -> None:
    """Policy `name` breaks its contract: a PolicyError matching `message` in the simulator and live, and live the
    model computes as before afterwards."""
    with pytest.raises(PolicyError, match=message):
        sim.simulate(_trace(), name, 2)
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    expertflow.wrap(model, cache_slots=slots, policy=name, device="cpu")
    try:
        with pytest.raises(PolicyError, match=message):
            model.generate(**inputs, **GEN)
    finally:
        expertflow.unwrap(model)
    assert torch.equal(model.generate(**inputs, **GEN), reference)


def test_a_plug_in_is_built_in_the_simulator_as_live_with_no_predictor_hook(fifo):
    """The simulator builds a registered policy with the arguments `wrap` gives it: no class attribute makes it pass
    a route predictor that the live runtime would not."""
    register_policy(type("Asks", (FIFO,), {"name": "asks-predictor", "needs_predictor": True}))
    assert not hasattr(sim, "needs_predictor")
    assert sim.simulate(_trace(), "asks-predictor", 2).as_dict() == sim.simulate(_trace(), "fifo", 2).as_dict()
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=3, policy="asks-predictor", device="cpu")
    expertflow.unwrap(model)


def test_an_absent_victim_is_a_policy_error_live_and_simulated(monkeypatch):
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    absent = lambda self, key, evictable, free: None if free else (1, 7) if key != (1, 7) else (0, 7)  # noqa: E731
    register_policy(type("Absent", (FIFO,), {"name": "absent-victim", "victim": absent}))
    _refused_live_and_simulated("absent-victim", 2,
                                r"policy 'absent-victim' chose \(\d, 7\) to make room for .*, but it is not resident")


def test_no_victim_without_a_free_slot_or_a_list_for_a_key_is_a_policy_error(monkeypatch):
    from expertflow.policy import WAVE

    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    register_policy(type("Never", (FIFO,), {"name": "never", "victim": lambda self, key, evictable, free: None}))
    with pytest.raises(PolicyError, match=r"policy 'never' returned no victim \(or WAVE\) for .* while the request "
                                          "holds"):
        sim.simulate(_trace(), "never", 2)
    # WAVE with nothing held: there is nothing to compute first
    register_policy(type("Always", (FIFO,), {"name": "always-wave", "victim": lambda self, key, evictable, free: WAVE}))
    with pytest.raises(PolicyError, match=r"'always-wave' returned no victim \(or WAVE\) for \(0, \d\) while the "
                                          "request holds no slot"):
        sim.simulate(_trace(), "always-wave", 2)
    register_policy(type("AsList", (FIFO,), {"name": "as-list", "victim": lambda self, key, evictable, free:
                                             None if free else list(next(iter(self.order)))}))
    with pytest.raises(PolicyError, match=r"returned \[\d, \d\] as the victim .* return a \(layer, expert\) tuple"):
        sim.simulate(_trace(), "as-list", 2)
    # a prefetch key given as a list: the same error as live
    register_policy(type("ListKeys", (FIFO,), {"name": "list-keys", "prefetches": lambda self, step, layer: [[0, 1]]}))
    with pytest.raises(PolicyError, match=r"policy 'list-keys' asked to prefetch \[0, 1\]; give \(layer, expert\)"):
        sim.simulate(_trace(), "list-keys", 2)


def test_a_prefetch_outside_the_model_is_refused_and_the_model_still_works(fifo):
    model = make_tiny("mixtral")
    inputs = batch("mixtral")
    reference = model.generate(**inputs, **GEN)
    fifo.prefetch_outside = True
    expertflow.wrap(model, cache_slots=3, policy="fifo", device="cpu")
    try:
        with pytest.raises(PolicyError, match=r"asked to prefetch \(\d, 8\), outside the model's 2 MoE layers x 8"):
            model.generate(**inputs, **GEN)
        assert torch.equal(model.generate(**inputs, **GEN), reference)
    finally:
        expertflow.unwrap(model)


@pytest.mark.parametrize("hook, value, message", [
    ("prefetches", None, r"policy 'bad-hook': prefetches\(\) returned None; return a list of \(layer, expert\) tuples"),
    ("prefetches", 3, r"policy 'bad-hook': prefetches\(\) returned 3; return a list"),
    ("prefetches", "", r"policy 'bad-hook': prefetches\(\) returned ''; return a list of \(layer, expert\) tuples "
                       r"\(an empty one for none\)"),
    ("cancellations", "ab", r"policy 'bad-hook': cancellations\(\) returned 'ab'; return a list"),
    ("cancellations", None, r"policy 'bad-hook': cancellations\(\) returned None; return a list of \(layer, expert\)"),
    ("cancellations", [[0, 1]], r"policy 'bad-hook' asked to cancel \[0, 1\]; give \(layer, expert\) tuples of int"),
    ("cancellations", [(0, 9)], r"policy 'bad-hook' asked to cancel \(0, 9\), outside the (model|trace)'s 2 MoE lay"),
])
def test_a_malformed_prefetches_or_cancellations_answer_is_a_policy_error_live_and_simulated(monkeypatch, hook, value,
                                                                                             message):
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    answer = (lambda self, step, layer: value) if hook == "prefetches" else (lambda self: value)
    register_policy(type("BadHook", (FIFO,), {"name": "bad-hook", hook: answer}))
    _refused_live_and_simulated("bad-hook", 3, message)


def test_a_bad_key_after_good_ones_is_refused_before_any_of_them_is_prefetched(monkeypatch):
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    register_policy(type("BadLast", (FIFO,), {"name": "bad-last", "prefetches": lambda self, step, layer:
                                              [(1, 0), (1, 1), (9, 0)]}))
    model = make_tiny("mixtral")
    expertflow.wrap(model, cache_slots=4, policy="bad-last", device="cpu")
    try:
        with pytest.raises(PolicyError, match=r"asked to prefetch \(9, 0\), outside the model's 2 MoE layers"):
            model.generate(**batch("mixtral"), **GEN)
        stats = expertflow.stats(model)
        assert stats.prefetches == 0 and stats.loads == 0  # the step's first call: nothing issued before the check
    finally:
        expertflow.unwrap(model)


@pytest.mark.parametrize("key", [(0, 1.5), (True, 0), (0.0, 1)])
def test_a_prefetch_key_of_non_integers_is_a_policy_error_live_and_simulated(monkeypatch, key):
    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    register_policy(type("Odd", (FIFO,), {"name": "odd-keys", "prefetches": lambda self, step, layer: [key]}))
    _refused_live_and_simulated(
        "odd-keys", 3, rf"policy 'odd-keys' asked to prefetch {re.escape(repr(key))}; give \(layer, expert\) tuples of "
                       "integers")


def test_numpy_integer_prefetch_keys_are_taken():
    numpy_keys = type("NumpyKeys", (FIFO,), {"name": "numpy-keys-test",
                                            "prefetches": lambda self, step, layer: [(np.int64(layer), np.int32(1))]})
    result = sim.simulate(_trace(), numpy_keys(2, 2, 8), 2)
    assert result.prefetches > 0


def test_a_policy_object_built_for_another_run_is_refused():
    with pytest.raises(ValueError, match="was built for 6 slots, 2 layers x 8 experts; this run has 4 slots"):
        sim.simulate(_trace(), make_policy("lru", 6, 2, 8), 4)
    policy = make_policy("lru", 4, 2, 8)
    sim.simulate(_trace(), policy, 4)
    with pytest.raises(ValueError, match="policy object 'lru' has already run; its state would carry over into this "
                                         "run: build a fresh one with make_policy"):
        sim.simulate(_trace(), policy, 4)  # its state would carry over


def test_a_plugin_policy_sees_ids_outside_the_layer_as_none(monkeypatch):
    """Policy.on_route promises -1 for 'none': an expert-parallel sentinel (an id past the last expert) must not
    reach a policy that reads the routes as they come."""
    from expertflow.policy.lru import LRUPolicy

    monkeypatch.setattr(policy_base, "_REGISTRY", dict(policy_base._REGISTRY))
    seen: list[int] = []
    register_policy(type("Recording", (LRUPolicy,), {
        "name": "recording", "on_route": lambda self, step, layer, routes: seen.extend(e for r in routes for e in r)}))
    model = make_tiny("mixtral")
    num_experts = model.config.num_local_experts
    index = torch.tensor([[0, num_experts], [3, 1], [num_experts + 5, 2]])
    weights = torch.rand(3, 2).masked_fill(index >= num_experts, 0.0)
    expertflow.wrap(model, cache_slots=2, policy="recording", device="cpu")
    try:
        with torch.no_grad():
            model.model.layers[0].mlp.experts(torch.randn(3, model.config.hidden_size), index, weights)
    finally:
        expertflow.unwrap(model)
    assert seen == [0, -1, 3, 1, -1, 2]
