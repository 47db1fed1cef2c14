"""Scheduling policies: the order waiting requests are offered admission, and what a step
holds (decodes, prefill chunks or both). A new policy is one module here, named in POLICIES."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.core.policies.base import Policy
from tidal.core.policies.longest_prefix_match import LongestPrefixMatch
from tidal.core.policies.prefill_first import PrefillFirst
from tidal.core.policies.priority import PriorityPolicy
from tidal.core.policies.slo import SloPolicy

if TYPE_CHECKING:
    from tidal.core.config import SchedulerConfig

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Policy, PrefillFirst, PriorityPolicy, LongestPrefixMatch,
                              SloPolicy)}


def make_policy(config: "SchedulerConfig") -> Policy:
    return POLICIES[config.policy](config)


__all__ = ["POLICIES", "LongestPrefixMatch", "Policy", "PrefillFirst", "PriorityPolicy",
           "SloPolicy", "make_policy"]
