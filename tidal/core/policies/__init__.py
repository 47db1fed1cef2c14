"""Scheduling policies: the order waiting requests are offered admission, and what a step
holds (decodes, prefill chunks or both). A new policy is one module here, named in POLICIES;
its `Options` become engine options (flags, `LLM` keywords, docs/configuration.md) and its
capabilities are what the server asks of it."""

from __future__ import annotations

from dataclasses import Field, fields
from typing import TYPE_CHECKING, Any, Mapping

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


def option_fields() -> dict[str, tuple[str, Field]]:
    """Every policy's options: name -> (the policy declaring it, its field), in POLICIES
    order. Two policies may share an option name; the first one's field describes it."""
    found: dict[str, tuple[str, Field]] = {}
    for name, cls in POLICIES.items():
        for f in fields(cls.Options):
            found.setdefault(f.name, (name, f))
    return found


def make_options(policy: str, given: Mapping[str, Any]) -> Policy.Options:
    """`policy`'s Options from option values by name. An option of another policy is a
    ValueError that names its policy; a name no policy declares, a TypeError."""
    cls = POLICIES[policy].Options
    own = {f.name for f in fields(cls)}
    for key in given:
        if key in own:
            continue
        owners = [n for n, c in POLICIES.items() if key in {f.name for f in fields(c.Options)}]
        if not owners:
            raise TypeError(f"unknown scheduler option {key!r}")
        kind = "policy" if len(owners) == 1 else "policies"
        raise ValueError(f"{key} is an option of the {' and '.join(owners)} {kind}; this "
                         f"scheduler runs {policy!r}")
    return cls(**given)


__all__ = ["POLICIES", "LongestPrefixMatch", "Policy", "PrefillFirst", "PriorityPolicy",
           "SloPolicy", "make_options", "make_policy", "option_fields"]
