"""Choose a plan for each match among the candidates its pattern offers.

The cheapest candidate by the cost model wins, unless ``fuser.plan`` forces a choice
(``attention.backward=atomic_dq``, ``attention.impl=inductor``, ...): forced values filter the
candidates first. The reason for the choice and every alternative with its estimate are kept
on the match for ``explain()``.
"""

from __future__ import annotations

from .options import FuserOptionError, Options
from .pattern import Candidate, Match


def choose(match: Match, candidates: list[Candidate], options: Options) -> tuple[Candidate, str]:
    """Pick the plan for ``match``.

    Returns:
        ``(plan, reason)``.

    Raises:
        FuserOptionError: ``fuser.plan`` forces a value no candidate has (the message lists
            the values that exist).
    """
    if not candidates:
        raise ValueError(f"pattern {match.pattern} offered no candidate plans")
    pool = list(candidates)
    forced_desc = []
    for key, value in options.plan:
        pattern, _, choice = key.partition(".")
        if pattern != match.pattern:
            continue
        relevant = [c for c in pool if choice in c.params]
        if not relevant:
            continue  # e.g. a backward choice for an inference-only match
        kept = [c for c in pool if c.params.get(choice, value) == value]
        if not kept:
            values = sorted({str(c.params[choice]) for c in relevant})
            raise FuserOptionError(
                f"fuser.plan forces {key}={value}, but {match.pattern} at {match.location} offers "
                f"{choice} in {values}"
            )
        pool = kept
        forced_desc.append(f"{key}={value}")
    best = min(pool, key=lambda c: c.estimate_ms)
    if forced_desc:
        return best, f"forced by fuser.plan ({', '.join(forced_desc)})"
    others = [c for c in candidates if c is not best]
    if not others:
        return best, "the only candidate"
    runner_up = min(others, key=lambda c: c.estimate_ms)
    return best, (
        f"lowest estimated time: {best.estimate_ms:.3g} ms vs {runner_up.estimate_ms:.3g} ms "
        f"for {runner_up.name}"
    )
