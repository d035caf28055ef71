"""Cache policies, one module per family; importing this package registers the built-in ones.

Owns: the registry of policy names. Does not know: tensors, devices or models.
"""

from expertflow.policy.base import (WAVE, ExpertKey, Policy, PolicyError, make_policy, policy_names,
                                    register_policy, routes_array)
from expertflow.policy import lru  # noqa: F401  (registers lru, lru-layer)
from expertflow.policy import belady, expertflow, lfu, lookahead, prev_step  # noqa: F401  (register the rest)

__all__ = ["ExpertKey", "Policy", "PolicyError", "make_policy", "policy_names", "register_policy", "routes_array",
           "WAVE"]
