"""Shrink a failing program: reset its features to their defaults one at a time, drop calls,
in-place writes and grad inputs, and make sizes smaller, keeping each change after which the
program still fails the same way (greedy, to a fixed point or until the budget is spent).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable, Iterator, Optional

from . import runner
from .grammar import Spec, normalize, render

#: fields tried first (they remove the most code), then every other field in declaration order
_FIRST = ("inplace", "between", "no_grad_block", "detach", "p_through", "out_post", "layout", "gqa", "mask",
          "scale", "magnitude", "shift", "softmax", "qk", "kt", "pv", "dtype", "grad")


def signature(outcome: runner.Outcome) -> str:
    """What must stay the same while shrinking: the failure class, and for crashes the
    exception's type, for missing/extra gradients whose (so that shrinking does not wander to
    another bug of the same class)."""
    if not outcome.failures:
        return outcome.status
    f = outcome.failures[0]
    if f.kind == "grad_presence":  # of the output, of a parameter, or of an input
        return "grad_presence:" + ("output" if f.detail.startswith("output") else
                                   "param" if "param:" in f.detail else "input")
    if f.kind == "crash":
        m = re.search(r"(\w+(Error|Exception|Failed))", f.detail)
        return f"crash:{m.group(1) if m else ''}"
    return f.kind


def candidates(spec: Spec) -> Iterator[Spec]:
    """Simpler variants of ``spec`` (normalised), most promising first."""
    if spec.pattern == "kda":
        from .kda_grammar import candidates as kda_candidates

        yield from kda_candidates(spec)
        return
    d = Spec(pattern=spec.pattern, seed=spec.seed)
    if len(spec.calls) > 1:
        for i in range(len(spec.calls)):
            yield dataclasses.replace(spec, calls=spec.calls[:i] + spec.calls[i + 1:])
    for i in range(len(spec.inplace)):
        yield dataclasses.replace(spec, inplace=spec.inplace[:i] + spec.inplace[i + 1:])
    names = [f.name for f in dataclasses.fields(Spec)]
    order = list(_FIRST) + [n for n in names if n not in _FIRST and n not in ("pattern", "seed", "calls")]
    for name in order:
        if getattr(spec, name) != getattr(d, name):
            yield dataclasses.replace(spec, **{name: getattr(d, name)})
    for i in range(len(spec.grad_inputs)):
        yield dataclasses.replace(spec, grad_inputs=spec.grad_inputs[:i] + spec.grad_inputs[i + 1:])
    for name, small in (("batch", 1), ("kv_heads", 1), ("group", 1)):
        if getattr(spec, name) != small:
            yield dataclasses.replace(spec, **{name: small})
    for name in ("head_dim", "head_dim_v"):
        v = getattr(spec, name)
        if v > 8:
            yield dataclasses.replace(spec, **{name: 8})
    for i, (nq, nk) in enumerate(spec.calls):
        # smaller calls only (sum of lengths strictly decreasing), not below 4 unless already
        for new in ((min(nq, nk),) * 2, (8, 8), (max(4, nq // 2), max(4, nk // 2)), (4, 4)):
            if sum(new) < nq + nk:
                yield dataclasses.replace(spec, calls=spec.calls[:i] + (new,) + spec.calls[i + 1:])


def minimise(outcome: runner.Outcome, *, max_runs: int = 60, max_seconds: float = 300.0,
             run: Optional[Callable[..., runner.Outcome]] = None, log: Callable[[str], None] = lambda s: None,
             **run_kwargs) -> runner.Outcome:
    """The smallest failing variant found of a failing ``outcome`` (itself if none smaller
    fails the same way). ``run`` defaults to :func:`runner.run` (``run_kwargs`` are passed on)."""
    run = run or runner.run
    want = signature(outcome)
    best = outcome
    seen = {outcome.program.source}
    runs, t0 = 0, time.time()
    improved = True
    while improved:
        improved = False
        for cand in candidates(best.program.spec):
            if runs >= max_runs or time.time() - t0 > max_seconds:
                return best
            prog = render(normalize(cand))
            if prog.source in seen:
                continue
            seen.add(prog.source)
            runs += 1
            got = run(prog, **run_kwargs)
            if got.status == "fail" and signature(got) == want:
                log(f"  shrink {runs}: kept {_diff(best.program.spec, prog.spec)}")
                best = got
                improved = True
                break
    return best


def _diff(a: Spec, b: Spec) -> str:
    out = []
    for f in dataclasses.fields(type(b)):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x != y:
            out.append(f"{f.name}: {x!r} -> {y!r}")
    return "; ".join(out) or "(same spec)"
