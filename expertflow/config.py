"""Configuration of the offloading runtime: one frozen dataclass, validated on construction.

Owns: the knobs a user can set and their validation. Does not know: devices, files or models. Nothing here queries
a GPU or touches the disk; resolving "auto" values against the machine happens in the runtime.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction

__all__ = ["Config", "parse_bytes", "parse_bandwidth", "check_policy_options", "POLICIES"]

# The built-in policies the live runtime accepts (and any registered plug-in); the simulator also runs `belady`.
POLICIES = ("lru", "lru-layer", "lfu", "lookahead", "prev-step", "expertflow")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
# what torch.device reads as written: no "cuda:01", and an index it keeps (in 8 signed bits: "cuda:256" is cuda:0)
_DEVICE_RE = re.compile(r"^(cpu|cuda)(:(0|[1-9][0-9]?|1[01][0-9]|12[0-7]))?$")
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*(?:/\s*[sS])?\s*$")
_PER_SECOND_RE = re.compile(r"\s*/\s*[sS]$")  # "/s", "/S", " / s": what ends a rate
# Units in bits: a prefix, then a lowercase "b" ("Gb", "Mib", "kb"), or "bit(s)" / "bps" in any case but "Bps"
_BITS_RE = re.compile(r"^([kKmMgGtT]?)(i?)(?:b|[bB][iI][tT][sS]?|bps|BPS)$")
_FRACTION_RE = re.compile(r"^\s*(0?\.[0-9]+|1\.0*)\s*$")  # "0.5", "1.0": text read as bytes, meant as a fraction


def parse_bytes(text: str | int, what: str = "size") -> int:
    """Parse "6GiB", "512MB", "1.5 GB" or an int into bytes. Raises ValueError naming the problem; a unit in bits
    ("6Gb", "6Gbit") is refused, not read as bytes."""
    if isinstance(text, bool):
        raise ValueError(f"{what}={text!r} is not a size; give bytes as an int or a string like '6GiB'")
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"{what}={text} must be positive")
        return text
    match = _SIZE_RE.match(str(text))
    if match is not None:
        _refuse_bits(match.group(1), match.group(2), "", what, text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{what}={text!r} is not a size; write a number with a unit such as '6GiB', '512MB' or '2.5GB'"
        )
    try:
        value = int(Fraction(match.group(1)) * _UNITS[unit])  # exact: in floats "4.135552MB" came out a byte short
    except ValueError:  # thousands of digits, past what Python converts
        raise ValueError(f"{what}={str(text)[:20]!r}… ({len(str(text)):,} characters) is not a size; write a number "
                         "with a unit such as '6GiB', '512MB' or '2.5GB'") from None
    if value <= 0 and float(match.group(1)) > 0:
        raise ValueError(f"{what}={text!r} is less than one byte; give a size with a unit such as '6GiB'")
    if value <= 0:
        raise ValueError(f"{what}={text!r} must be positive")
    return value


def parse_bandwidth(text: str) -> float:
    """Parse "16GB/s", "400MB/s", "2GiB/s" or "16 GB / s" into bytes per second; a rate in bits ("16Gb/s", "16Gbps")
    is refused."""
    raw = str(text).strip()
    match = _RATE_RE.match(raw)
    if match is not None:
        _refuse_bits(match.group(1), match.group(2), "/s", "link_bandwidth", text)
    per_second = _PER_SECOND_RE.search(raw)
    if per_second is None:
        raise ValueError(f"link_bandwidth={text!r} must be a rate such as '16GB/s' or '400MB/s'")
    try:
        return float(parse_bytes(raw[:per_second.start()], what="link_bandwidth"))
    except ValueError:
        raise ValueError(f"link_bandwidth={text!r} must be a positive rate such as '16GB/s' or '400MB/s'") from None


def _refuse_bits(number: str, unit: str, per: str, what: str, text: object) -> None:
    """A unit in bits (a lowercase b after the prefix, "bit", "bps") would be 8x off if read as bytes: refuse it,
    naming the same amount in bytes."""
    bits = _BITS_RE.match(unit)
    if bits is None:
        return
    prefix, binary = bits.group(1), bits.group(2)
    unit = ("k" if prefix == "k" and not binary else prefix.upper()) + ("iB" if binary else "B") + per  # kB, KiB
    raise ValueError(f"{what}={text!r} is in bits; expertflow takes bytes, written with a capital B: that is "
                     f"'{float(number) / 8:g}{unit}' in bytes (or '{number}{unit}' if you meant bytes)")


@dataclass(frozen=True)
class Config:
    """How `expertflow.wrap` offloads a model.

    cache_slots: total expert slots on the device, shared by all MoE layers (clamped to the number of experts).
    gpu_budget: device memory for the whole model's weights (non-expert weights + slot bank; slots = (budget -
        non-expert bytes) // one expert's bytes): "6GiB", an int of bytes, or a float in (0, 1] meaning that fraction
        of the device memory free for the model (free, plus what the model and PyTorch's caching allocator already
        hold there; on the CPU device, of the host's free physical memory). Give exactly one of `cache_slots` /
        `gpu_budget` on an accelerator; on CPU the default is a quarter of the experts.
    policy: cache policy, one of POLICIES.
    device: compute device ("cuda", "cuda:1", "cpu", or a torch.device); None picks CUDA when available, else CPU.
    link_bandwidth: CPU device only: throttle host→slot copies to emulate a PCIe link, e.g. "16GB/s".
    predictor: path to a trained route-path predictor directory (used by predictive policies).
    pin_memory: page-lock the host expert store when the device is CUDA (`expertflow.store`).
    policy_options: keyword arguments for the policy's constructor, e.g. {"waves": True} for `expertflow`
        (docs/cache_engine.md); None = its defaults. Their names are checked here, their values by the constructor
        (`wrap` builds the policy before it touches the model).

    Sizes and rates are in bytes, the unit written with a capital B ("6GB", "6GiB", "16GB/s"); a unit in bits
    ("16Gb/s", "6gb", "Gbit", "Gbps") is refused. A bad value raises ValueError naming the field and the fix (`wrap`
    raises it as a WrapError).
    """

    cache_slots: int | None = None
    gpu_budget: str | int | float | None = None
    policy: str = "lru"
    device: str | None = None
    link_bandwidth: str | None = None
    predictor: str | None = None
    pin_memory: bool = True
    policy_options: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.cache_slots is not None:
            try:  # numpy and 0-d tensor integers too, but not bools (a bool tensor included) or floats
                if isinstance(self.cache_slots, bool) or str(getattr(self.cache_slots, "dtype", "")) == "torch.bool":
                    raise TypeError
                object.__setattr__(self, "cache_slots", operator.index(self.cache_slots))
            except TypeError:
                raise ValueError(f"cache_slots={self.cache_slots!r} must be an int (total expert slots), e.g. 64") \
                    from None
            if self.cache_slots < 1:
                raise ValueError(f"cache_slots={self.cache_slots} must be at least 1; one slot is the minimum that "
                                 "works")
        if self.cache_slots is not None and self.gpu_budget is not None:
            raise ValueError(
                f"cache_slots={self.cache_slots} and gpu_budget={self.gpu_budget!r} were both given; give only one"
            )
        if self.gpu_budget is not None:
            budget = self.gpu_budget
            if isinstance(budget, numbers.Real) and not isinstance(budget, numbers.Integral):  # np.float32 too
                budget = float(budget)
                if not 0.0 < budget <= 1.0:
                    raise ValueError(
                        f"gpu_budget={budget} as a float is a fraction of free device memory (host memory on the "
                        "CPU) and must be in (0, 1]"
                    )
                object.__setattr__(self, "gpu_budget", budget)  # the runtime reads a fraction as a float
            elif isinstance(budget, str) and _FRACTION_RE.match(budget):
                raise ValueError(f"gpu_budget={budget!r} is text; give a fraction of free device memory as a float "
                                 f"({budget.strip()}) or a size with a unit such as '6GiB'")
            else:
                parse_bytes(budget, what="gpu_budget")
        if self.policy not in POLICIES:
            _check_registered(self.policy)
        if self.link_bandwidth is not None:
            parse_bandwidth(self.link_bandwidth)
            if self.device is not None and not str(self.device).startswith("cpu"):
                raise ValueError(
                    f"link_bandwidth={self.link_bandwidth!r} emulates a link on the CPU device only; "
                    f"drop it or set device='cpu' (device={self.device!r})"
                )
        if self.device is not None:
            if not isinstance(self.device, str) and hasattr(self.device, "type"):  # a torch.device
                object.__setattr__(self, "device", str(self.device))
            if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
                raise ValueError(f"device={self.device!r} is not supported; expertflow computes on 'cuda', 'cuda:N' "
                                 "or 'cpu'")
        if self.predictor is not None:
            if not isinstance(self.predictor, (str, os.PathLike)):
                raise ValueError(f"predictor={self.predictor!r} must be the path of a trained predictor directory")
            object.__setattr__(self, "predictor", os.fspath(self.predictor))
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory={self.pin_memory!r} must be True or False")
        if self.policy_options is not None:
            check_policy_options(self.policy, self.policy_options)
            object.__setattr__(self, "policy_options", dict(self.policy_options))  # the caller's dict may change

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            names = ", ".join(sorted(unknown))
            fields = ", ".join(f.name for f in dataclasses.fields(self))
            raise TypeError(f"unknown Config field(s) {names}; known fields: {fields}")
        return dataclasses.replace(self, **changes)

    @property
    def link_bytes_per_s(self) -> float | None:
        return None if self.link_bandwidth is None else parse_bandwidth(self.link_bandwidth)


def check_policy_options(policy: str, options: object) -> None:
    """`options` is a dict of keyword arguments that `policy`'s constructor takes (its values it checks itself)."""
    import inspect

    from expertflow.policy.base import policy_class

    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"policy_options={options!r} must be a dict of option names to values, e.g. "
                         "{'waves': True}")
    params = inspect.signature(policy_class(policy).__init__).parameters
    known = [n for n, p in params.items() if n not in ("self", "capacity", "num_layers", "num_experts")
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"policy_options: {', '.join(map(repr, unknown))} is not an option of policy {policy!r}; "
                         f"its options are {', '.join(known) or 'none'}")


def _check_registered(name: object) -> None:
    """`name` is a policy registered with `@register_policy` that runs live (not an oracle)."""
    from expertflow.policy.base import policy_names  # plain Python: registers the built-ins, touches no device

    if isinstance(name, str) and name in policy_names(include_oracles=False):
        return
    if isinstance(name, str) and name in policy_names():
        raise ValueError(f"policy={name!r} needs the future routes and runs only in the simulator (expertflow "
                         f"simulate); choose one of {', '.join(policy_names(include_oracles=False))}")
    raise ValueError(f"policy={name!r} is unknown; choose one of {', '.join(policy_names(include_oracles=False))}, "
                     "or register your own with @expertflow.policy.register_policy (docs/cache_engine.md)")
