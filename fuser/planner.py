"""Choose a plan for each match among the candidates its pattern offers.

The cheapest candidate by the cost model wins, unless ``fuser.plan`` forces a choice
(``attention.backward=atomic_dq``, ``attention.impl=inductor``, ...): forced values filter the
candidates first. Under ``torch.use_deterministic_algorithms(True)`` candidates whose results
may vary between runs (atomic accumulation) are left out, as PyTorch leaves out its own
nondeterministic kernels. The reason for the choice and every alternative with its estimate are
kept on the match for ``explain()``.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .options import FuserOptionError, Options
from .pattern import Candidate, Match, Pattern, match_device


def choose(match: Match, candidates: list[Candidate], options: Options,
           pattern: Optional[Pattern] = None) -> tuple[Candidate, str]:
    """Pick the plan for ``match`` (of ``pattern``, which explains a forced value it does not
    offer: :meth:`fuser.pattern.Pattern.why_not_offered`).

    Returns:
        ``(plan, reason)``.

    Raises:
        FuserOptionError: ``fuser.plan`` forces a value no candidate has (the message lists
            the values that exist), or a value only nondeterministic candidates have while
            ``torch.use_deterministic_algorithms(True)`` is on (with ``warn_only=True``: a
            warning instead, and the forced plan may run).
    """
    if not candidates:
        raise ValueError(f"pattern {match.pattern} offered no candidate plans")
    pool = list(candidates)
    forced_desc = []
    strict = torch.are_deterministic_algorithms_enabled()
    for key, value in options.plan:
        name, _, choice = key.partition(".")
        if name != match.pattern:
            continue
        relevant = [c for c in pool if choice in c.params]
        if not relevant:
            continue  # e.g. a backward choice for an inference-only match
        offered = sorted({str(c.params[choice]) for c in relevant})
        if str(value) not in offered:
            raise FuserOptionError(
                f"fuser.plan forces {key}={value}, but {match.pattern} at {match.location} offers "
                f"{choice} in {offered}{_why_not_offered(match, choice, str(value), key, pattern)}"
            )
        if strict and not any(c.deterministic for c in relevant if str(c.params[choice]) == str(value)):
            message = (f"fuser.plan forces {key}={value} for {match.pattern} at {match.location}, which is "
                       "not deterministic, while torch.use_deterministic_algorithms(True) is on: drop "
                       f"{key} from fuser.plan or turn deterministic algorithms off")
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise FuserOptionError(message)
            warnings.warn(message, stacklevel=2)
            strict = False  # warn_only: the user's forced plan runs
        # candidates without this choice (e.g. "inductor" for a backward mode) stay in the pool
        pool = [c for c in pool if str(c.params.get(choice, value)) == str(value)]
        forced_desc.append(f"{key}={value}")
    left_out = False
    if strict:
        kept = [c for c in pool if c.deterministic]
        if kept:
            left_out = len(kept) < len(pool)
            pool = kept
    best = min(pool, key=lambda c: c.estimate_ms)
    if forced_desc:
        return best, f"forced by fuser.plan ({', '.join(forced_desc)})"
    others = [c for c in pool if c is not best]
    note = "; nondeterministic plans left out (torch.use_deterministic_algorithms)" if left_out else ""
    if not others:
        return best, "the only candidate" + note
    dev = match_device(match)
    if options.cuda_graphs and dev is not None and dev.type == "cuda":
        note += "; launches cost no host time (the graph is replayed from CUDA graphs)"
    runner_up = min(others, key=lambda c: c.estimate_ms)
    return best, (
        f"lowest estimated time: {best.estimate_ms:.3g} ms vs {runner_up.estimate_ms:.3g} ms "
        f"for {runner_up.name}{note}"
    )


def _why_not_offered(match: Match, choice: str, value: str, key: str, pattern: Optional[Pattern] = None) -> str:
    """Why a valid ``fuser.plan`` value is not among a match's candidates, when known: the
    text to append to the error ("" when there is nothing to add). ``impl=inductor`` (every
    pattern's "leave it as written") on CPU tensors here; the rest from the pattern."""
    if choice == "impl" and value == "inductor":
        dev = match_device(match)
        if dev is not None and dev.type == "cpu":
            return (f": Inductor plans exist only on CUDA; these tensors are on the CPU, where fuser's kernels "
                    f"run in Triton's interpreter. Drop {key} from fuser.plan, or leave CPU regions to Inductor "
                    "with fuser.interpret=False")
    why = pattern.why_not_offered(match, choice, value) if pattern is not None else ""
    return f": {why}" if why else ""
