"""Differential fuzzing of ``backend="fuser"`` against eager PyTorch (issue 8, "Never wrong").

- ``test_fuzz_budget``: a fixed-seed budget of random programs (CI: CPU, kernels in Triton's
  interpreter). Every failing program is reported with its source, program seed and what
  differed; ``python -m tests.soundness.fuzz --program <seed>`` re-runs and shrinks one.
- ``test_causal_data_masks_reach_the_run_time_mask_test``: random programs whose data mask
  holds a causal mask's values (changed between calls) equal eager and reach each bit of the
  attention launcher's run-time mask test.
- ``test_known_failure``: the minimal programs of the failure classes found so far
  (:mod:`.corpus`), one test each; a class whose fix belongs elsewhere is a strict xfail (its
  ``xfail`` reason), so that the fix landing shows.
- the rest tests the harness itself: generation is deterministic and (almost always) valid
  Python that eager runs; planted wrong answers, wrong gradients, crashes and recompiles are
  caught; the NaN rules; shrinking.

A failure of the budget tests fails CI.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from . import corpus, fuzz, grammar, minimise, runner
from .grammar import Spec, render

CI_SEED = 8
CI_COUNT = int(os.environ.get("FUSER_FUZZ_CI_COUNT", "16"))
KDA_CI_SEED = 31
KDA_CI_COUNT = int(os.environ.get("FUSER_FUZZ_KDA_CI_COUNT", "6"))


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Kernels on CPU tensors run in Triton's interpreter (this module's tests only)."""
    monkeypatch.setenv("FUSER_INTERPRET", "1")


def _report(failures: list) -> str:
    parts = [f"{len(failures)} program(s) compiled with backend='fuser' differ from eager:"]
    for o in failures:
        parts.append("=" * 100)
        kda = " --pattern kda" if o.program.spec.pattern == "kda" else ""
        parts.append(f"program seed {o.program.spec.seed} (re-run and shrink: "
                     f"python -m tests.soundness.fuzz{kda} --program {o.program.spec.seed})")
        parts.append(runner.format_failure(o))
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# The fuzzing itself
# --------------------------------------------------------------------------------------------

def test_fuzz_budget():
    """CI_COUNT random programs (seed CI_SEED) compiled with fuser equal eager."""
    specs = [fuzz.program_spec(CI_SEED, i) for i in range(CI_COUNT)]
    stats, failures = fuzz.fuzz(specs, minimise=False, log=lambda s: None)
    print(stats.table())
    assert stats.programs == CI_COUNT
    assert stats.discarded < CI_COUNT // 2, "the generator makes too many programs eager rejects"
    if failures:
        pytest.fail(_report(failures), pytrace=False)


CAUSAL_DATA_SEED = 2
CAUSAL_DATA_COUNT = int(os.environ.get("FUSER_FUZZ_CAUSAL_DATA_COUNT", "8"))


def test_causal_data_masks_reach_the_run_time_mask_test(monkeypatch):
    """Random attention programs whose data mask holds a causal mask's values (``data_values=
    "causal"``: what a block compiled on its own receives, changed at later calls) equal eager,
    and the launcher's run-time mask test (``mask_tiles_skippable``) answered with each of its
    bits among them: the kernels' skipping paths (the tiles above the diagonal, the mask left
    unread below it) ran, and so did the refusals."""
    from fuser.codegen import attention

    flags = []
    test = attention.mask_tiles_skippable

    def recorded(*args, **kw):
        flag = test(*args, **kw)
        flags.append(int(flag))
        return flag

    monkeypatch.setattr(attention, "mask_tiles_skippable", recorded)
    # programs of several calls: the later calls change the mask's values under the compiled graph
    specs = [s for s in (fuzz.program_spec(CAUSAL_DATA_SEED, i) for i in range(4000))
             if s.data_values == "causal" and s.pattern == "attention" and len(s.calls) > 1][:CAUSAL_DATA_COUNT]
    assert len(specs) == CAUSAL_DATA_COUNT
    stats, failures = fuzz.fuzz(specs, minimise=False, log=lambda s: None)
    print(stats.table(), "flags:", sorted(set(flags)))
    if failures:
        pytest.fail(_report(failures), pytrace=False)
    both = attention.MASK_SKIP_ABOVE | attention.MASK_FREE_BELOW
    assert both in flags and attention.MASK_FREE_BELOW in flags, flags


def test_kda_fuzz_budget():
    """KDA_CI_COUNT random KDA loops (seed KDA_CI_SEED) compiled with fuser equal eager: fused
    where the pattern can prove the loop, declined otherwise. fuser's rewritten graphs run
    through aot_eager here (``fuser_fast``: the KDA op and the pass as in the backend, the rest
    not compiled to C++); ``python -m tests.soundness.fuzz --pattern kda`` runs them with Inductor."""
    specs = [fuzz.program_spec(KDA_CI_SEED, i, "kda") for i in range(KDA_CI_COUNT)]
    stats, failures = fuzz.fuzz(specs, minimise=False, log=lambda s: None, backend="fuser_fast",
                                confirm_backend="aot_eager")
    print(stats.table())
    assert stats.programs == KDA_CI_COUNT and stats.discarded < KDA_CI_COUNT // 2
    if failures:
        pytest.fail(_report(failures), pytrace=False)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=c.xfail))
                                  if c.xfail else c for c in corpus.CASES], ids=[c.name for c in corpus.CASES])
def test_known_failure(case):
    """The minimal program of each failure class found by the fuzzer equals eager."""
    # Inductor alone computes these programs right (checked when they were found): no confirm
    o = runner.run(render(case.spec), confirm_failures=False)
    assert o.status != "discard", o.reason
    if o.status == "fail":
        pytest.fail(f"{case.name}: {case.note}\n" + _report([o]), pytrace=False)


# --------------------------------------------------------------------------------------------
# The generator
# --------------------------------------------------------------------------------------------

def test_generation_is_deterministic():
    a = [render(fuzz.program_spec(3, i)).source for i in range(20)]
    b = [render(fuzz.program_spec(3, i)).source for i in range(20)]
    assert a == b
    assert len(set(a)) == 20


def test_generated_programs_run_eagerly():
    """Nearly every generated program is valid Python that eager PyTorch runs; specs are
    fixed points of normalisation (so shrinking by resetting fields is well defined)."""
    ok, kinds = 0, set()
    n = 120
    for i in range(n):
        spec = fuzz.program_spec(11, i)
        assert grammar.normalize(spec) == spec
        prog = render(spec)
        ns = runner.load(prog)
        fn = ns.program if prog.entry == "program" else ns.Program().to(ns.DTYPE)
        x = ns.make_inputs(*ns.CALLS[0], seed=0, dtype=ns.DTYPE)
        try:
            out = fn(**x)
        except Exception:  # noqa: BLE001 - e.g. an in-place write on a leaf that needs grad
            continue
        ok += 1
        assert torch.is_tensor(out)
        kinds.add((spec.pattern, spec.mask))
    assert ok >= 0.9 * n
    assert len(kinds) >= 12  # both patterns, most mask kinds


def test_kda_programs_run_eagerly_and_reach_every_mutation():
    """The KDA generator: deterministic, specs are fixed points of normalisation, programs (and
    their float64 oracles) run eagerly, every spelling and mutation is drawn."""
    from . import kda_grammar

    specs = [fuzz.program_spec(11, i, "kda") for i in range(800)]
    assert [render(s).source for s in specs[:10]] == [render(fuzz.program_spec(11, i, "kda")).source
                                                    for i in range(10)]
    ok = 0
    for spec in specs[:60]:
        assert kda_grammar.normalize(spec) == spec
        prog = render(spec)
        for p, dt in ((prog, None), (prog.variant(), torch.float64)):
            ns = runner.load(p)
            x = ns.make_inputs(*ns.CALLS[0], seed=0, dtype=dt or ns.DTYPE)
            out = ns.program(**x)
            assert torch.is_tensor(out) and (dt is None or out.dtype == torch.float64)
        ok += 1
    assert ok == 60
    seen: dict = {}
    for spec in specs:
        for f in ("mutation", "layout", "select", "upcast", "decay", "vhat", "update", "readout", "scale",
                  "assembly", "gate", "h0", "gate_values", "beta_values", "grad", "dtype"):
            seen.setdefault(f, set()).add(getattr(spec, f))
    assert seen["mutation"] == set(kda_grammar.MUTATIONS)
    for f, values in (("layout", kda_grammar.LAYOUTS), ("decay", kda_grammar.DECAYS),
                      ("assembly", kda_grammar.ASSEMBLIES), ("gate_values", kda_grammar.GATE_VALUES),
                      ("beta_values", kda_grammar.BETA_VALUES), ("grad", kda_grammar.GRAD_MODES)):
        assert set(values) <= seen[f], (f, set(values) - seen[f])


def test_every_feature_value_is_reachable():
    """Sampling reaches every value of the main feature axes."""
    seen: dict = {}
    for i in range(600):
        spec = fuzz.program_spec(5, i)
        for f in ("qk", "pv", "softmax", "scale", "mask", "builder", "mask_apply", "fill", "gqa", "grad", "dynamic",
                  "dtype", "kl_spelling", "kl_reduction", "no_grad_block", "between"):
            seen.setdefault(f, set()).add(getattr(spec, f))
    expect = {
        "qk": set(grammar.QK_FORMS), "softmax": set(grammar.SOFTMAX_FORMS), "scale": set(grammar.SCALES),
        "mask": set(grammar.MASKS), "builder": set(grammar.BUILDERS), "mask_apply": set(grammar.MASK_APPLY),
        "gqa": set(grammar.GQA_FORMS), "grad": set(grammar.GRAD_MODES), "dynamic": {True, False, None},
        "dtype": {"float32", "float16"}, "kl_spelling": set(grammar.KL_SPELLINGS),
        "kl_reduction": set(grammar.KL_REDUCTIONS), "no_grad_block": set(grammar.NO_GRAD_BLOCKS),
        "between": set(grammar.BETWEEN),
    }
    for f, values in expect.items():
        assert values <= seen[f], (f, values - seen[f])
    assert set(grammar.HIDING_FILLS) | {"-100", "-5"} <= seen["fill"]


# --------------------------------------------------------------------------------------------
# The runner catches planted bugs
# --------------------------------------------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 1.01


def _planted(kind: str):
    def backend(gm, example_inputs, **_):
        if kind == "crash":
            raise RuntimeError("planted crash")
        if kind == "recompile":
            for x in example_inputs:  # specialise every size: a recompile per new length
                if isinstance(x, torch.SymInt):
                    int(x)

        def call(*args):
            outs = gm(*args)
            if kind == "value":
                return type(outs)(o * 1.01 if torch.is_tensor(o) and o.is_floating_point() else o for o in outs)
            if kind == "grad":
                return type(outs)(_ScaleGrad.apply(o) if torch.is_tensor(o) and o.requires_grad else o for o in outs)
            return outs

        return call

    return backend


@pytest.fixture
def planted():
    names = {}
    for kind in ("value", "grad", "crash", "recompile"):
        names[kind] = f"planted_{kind}"
        runner.BACKENDS[names[kind]] = _planted(kind)
    yield names
    for n in names.values():
        runner.BACKENDS.pop(n, None)


PLAIN = Spec(mask="causal_tl", scale="sqrt_d", grad="train", grad_inputs=("q", "k", "v"), calls=((9, 9),))


@pytest.mark.parametrize("kind,expect", [("value", "forward"), ("grad", "grad"), ("crash", "crash")])
def test_runner_catches_planted_bug(planted, kind, expect):
    o = runner.run(render(PLAIN), backend=planted[kind], confirm_backend="aot_eager")
    assert o.status == "fail" and o.kind == expect, o.summary()


def test_runner_catches_planted_recompiles(planted):
    spec = dataclasses.replace(PLAIN, calls=((9, 9), (13, 13)), dynamic=True, grad="none", grad_inputs=())
    o = runner.run(render(spec), backend=planted["recompile"], confirm_backend="aot_eager")
    assert o.status == "fail" and o.kind == "recompile", o.summary()
    assert o.compiles == {planted["recompile"]: 2, "aot_eager": 1}


def test_runner_passes_eager_itself():
    """The harness finds no difference between eager and eager (aot_eager): nothing in it
    fails for lack of a bug."""
    for i in range(6):
        o = runner.run(render(fuzz.program_spec(4, i)), backend="aot_eager", confirm_backend=None)
        assert o.status in ("pass", "discard"), o.summary()


def test_confirmed_failures_are_not_blamed_on_the_backend(planted):
    """A difference that the confirming backend has too is ``both_fail``, not a failure."""
    runner.BACKENDS["planted_value_2"] = runner.BACKENDS[planted["value"]]
    try:
        o = runner.run(render(PLAIN), backend=planted["value"], confirm_backend="planted_value_2")
    finally:
        runner.BACKENDS.pop("planted_value_2")
    assert o.status == "both_fail"


# --------------------------------------------------------------------------------------------
# Comparison rules
# --------------------------------------------------------------------------------------------

def test_nan_rules():
    want = torch.tensor([[1.0, 2.0], [float("nan"), float("nan")]], dtype=torch.float64)
    hidden = torch.isnan(want)
    zero_row = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    # eager NaN on a fully hidden row, fuser 0: allowed
    assert runner.compare(zero_row, want, None, torch.float32, runner.BASE_TOL, zero_ok=hidden)[0] is None
    # ... but not without the allowance, nor with a non-zero row
    assert runner.compare(zero_row, want, None, torch.float32, runner.BASE_TOL)[0] == "nan"
    bad_row = torch.tensor([[1.0, 2.0], [0.5, 0.0]])
    assert runner.compare(bad_row, want, None, torch.float32, runner.BASE_TOL, zero_ok=hidden)[0] == "nan"
    # fuser NaN where eager is finite
    fin = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    assert runner.compare(torch.tensor([[1.0, float("nan")], [3.0, 4.0]]), fin, None, torch.float32,
                          runner.BASE_TOL)[0] == "nan"
    # ... unless eager at the program's own dtype is NaN there too (a precision effect)
    own = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    assert runner.compare(own.clone(), fin, own, torch.float32, runner.BASE_TOL)[0] is None
    # values: tolerance scaled by dtype and by eager's own error
    assert runner.compare(fin.float() * 1.001, fin, fin.float(), torch.float32, runner.BASE_TOL)[0] == "value"
    assert runner.compare(fin.half() * 1.001, fin, fin.half(), torch.float16, runner.BASE_TOL)[0] is None


# --------------------------------------------------------------------------------------------
# Shrinking
# --------------------------------------------------------------------------------------------

def test_minimise_keeps_only_what_the_failure_needs():
    def fake_run(prog, **_):
        s = prog.spec
        o = runner.Outcome(prog)
        if s.mask == "window" and len(s.calls) == 2:
            o.status, o.failures = "fail", [runner.Failure("forward", 1, "planted")]
        return o

    start = None
    for i in range(2000):
        s = fuzz.program_spec(6, i)
        if s.mask == "window" and len(s.calls) == 2 and len(s.features()) > 10:
            start = s
            break
    assert start is not None
    first = fake_run(render(start))
    small = minimise.minimise(first, run=fake_run, max_runs=500)
    assert set(small.program.spec.features()) <= {"mask", "window", "calls"}, small.program.spec.features()


def test_specs_round_trip_through_the_corpus_format():
    s = fuzz.program_spec(1, 3)
    assert eval(repr(s), {"Spec": Spec}) == s
