"""Run one rendered program compiled with fuser and eagerly, and say where they differ.

For each call in the program's ``CALLS`` (with fresh, seeded inputs; module state carries over
between calls in every run, as it would for a user):

- **oracle**: eager in float64 on float64 copies of the inputs (the programs are
  dtype-generic; a softmax pinned to float32 is unpinned, :meth:`.grammar.Program.variant`); eager at the program's own dtype sets the tolerance (``SLACK`` times its own
  error against the oracle, at least ``BASE_TOL``);
- **forward**: shape, dtype, values, and NaN/inf positions of the output;
- **gradients** of every input and parameter that requires grad (None against a tensor is a
  difference), for a seeded upstream gradient;
- **side effects**: inputs and module state after the call (in-place writes);
- **exceptions**: eager raising (forward or backward) discards the program; fuser raising
  where eager does not is a failure unless ``backend="inductor"`` raises too;
- **recompiles**: graphs compiled over the whole call sequence, against ``aot_eager`` and, when
  fuser compiled more, against ``inductor`` (fuser must not compile more often than Inductor);
- **internal errors**: a pattern that raised while matching or rewriting (fuser warns and leaves
  the region to Inductor, so the values are right, but the pattern has a bug).

Oracle details:

- where the float64 oracle is not finite but eager at the program's own dtype is (a program
  that is not dtype-generic there, e.g. ``finfo(float64).min`` cast to float32 is ``-inf``),
  the own-dtype value is the oracle; where fuser and own-dtype eager are both non-finite, the
  program's precision is at fault, not fuser;
- query rows with no visible key (found by re-running the program with every mask fill
  replaced by ``-inf``) get a zero upstream gradient: README promises exact gradients under
  that condition (padded positions in a masked loss);
- gradient errors are relative to the largest gradient of the call (at least a tenth of it,
  and ``GRAD_FLOOR``): gradients that cancel to ~0 in exact arithmetic keep float32 noise.

Allowed differences (counted, not failures):

- ``nan_row_zero``: a query row whose keys are all hidden by ``-inf`` is NaN in eager and 0 in
  fuser (README, Limits). The gradients' oracle is then the program with every ``-inf`` fill
  replaced by ``-1e300`` (where eager's backward is finite).
- ``finite_fill_row_zero`` (documented): a row fully hidden by a ``masked_fill``/``where``
  with a *finite* fill <= -1e4 is a uniform average in eager and 0 in fuser (README, Limits).
  Additive finite masks get no such allowance (README promises eager's forward there).
- ``kl_nan_limit``: attention-KL terms that eager computes as NaN through ``0 * log 0`` (``-inf``
  fills, or ``log(softmax(s))`` underflowing) are compared with eager's limit: the program with
  ``log_softmax`` and, where it fills with ``-inf``, ``-1e300`` fills (finite fills are kept)
  (:meth:`.grammar.Program.variant`).
- ``nomax_underflow`` (documented): a softmax written without the max (``exp(s) / exp(s).sum()``)
  is 0 / 0 = NaN in eager where every exp of a row underflows (e.g. a row filled with -3e4);
  fuser computes the softmax, with the max (README, Limits). Compared there with the program
  with the max subtracted (:meth:`.grammar.Program.variant`).
- ``mask_buffer_mutated`` (documented): the program mutates a registered mask buffer between
  calls; masks read from buffers are assumed constant (README, Limits). A difference in such
  a program is reported under this class, not as a failure.
- ``grad_oracle_nan``: eager's gradient is NaN and no finite oracle exists; compared where it
  is finite.
- ``no_float64_oracle``: the program raises in float64 (not dtype-generic); eager at its own
  dtype is the oracle.

Whether the region was fused or declined (and why) is recorded for statistics only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib.util
import os
import tempfile
import time
import weakref
from typing import Any, Callable, Optional

import torch

import fuser  # noqa: F401  (registers the backend)
from fuser.report import collecting

from .grammar import Program

#: failure classes (a failing program gets the first one found)
FAILURE_KINDS = ("crash", "shape", "dtype", "forward_nan", "forward", "grad_presence", "grad_nan", "grad",
                 "mutation", "recompile", "internal")
#: allowed or documented differences (counted, not failures)
ALLOWED_KINDS = ("nan_row_zero", "finite_fill_row_zero", "kl_nan_limit", "mask_buffer_mutated", "grad_oracle_nan",
                 "no_float64_oracle", "nomax_underflow")

BASE_TOL = {torch.float32: 2e-4, torch.float16: 1e-2}
BASE_GRAD_TOL = {torch.float32: 1e-3, torch.float16: 3e-2}
SLACK = 8.0
FLOOR = 1e-6  # relative errors are |got - want| / max(max|want|, FLOOR)
#: gradients: inputs and upstream gradients are O(1), so a gradient that is 0 in exact
#: arithmetic (e.g. keys no query sees) is compared at this absolute scale
GRAD_FLOOR = 1e-3


@dataclasses.dataclass
class Failure:
    """One difference: ``kind`` (see :data:`FAILURE_KINDS`), the ``call`` it appeared in
    (-1: the call sequence as a whole) and a readable ``detail``."""

    kind: str
    call: int
    detail: str

    def __str__(self) -> str:
        where = f"call {self.call}" if self.call >= 0 else "call sequence"
        return f"[{self.kind}] {where}: {self.detail}"


@dataclasses.dataclass
class Outcome:
    """What :func:`run` found for one program.

    Attributes:
        program: the :class:`~.grammar.Program`.
        status: ``"pass"``, ``"fail"``, ``"discard"`` (eager rejects the program) or
            ``"both_fail"`` (fuser and Inductor both raise: not fuser's doing).
        failures: the differences (empty unless ``status == "fail"``).
        reason: why the program was discarded (or what both backends raised).
        fused: regions fused (``fuser.report``), over all graphs compiled.
        declined: reasons of near-misses and of matches left to Inductor.
        allowed: allowed/documented differences seen (:data:`ALLOWED_KINDS`).
        compiles: graphs compiled per backend over the call sequence.
        seconds: wall time.
        minimised_from: the spec this (shrunk) program was minimised from, if it was.
    """

    program: Program
    status: str = "pass"
    failures: list = dataclasses.field(default_factory=list)
    reason: str = ""
    fused: int = 0
    declined: list = dataclasses.field(default_factory=list)
    allowed: list = dataclasses.field(default_factory=list)
    compiles: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    minimised_from: Optional[Any] = None

    @property
    def kind(self) -> str:
        """The failure class (the first failure's kind), or the status."""
        return self.failures[0].kind if self.failures else self.status

    def summary(self) -> str:
        lines = [f"status: {self.status}" + (f" ({self.reason})" if self.reason else "")]
        lines += [f"  {f}" for f in self.failures]
        lines.append(f"  fused regions: {self.fused}; declined: {self.declined or '-'}; allowed: {sorted(set(self.allowed)) or '-'}")
        lines.append(f"  graphs compiled: {self.compiles}")
        return "\n".join(lines)


class _Discard(Exception):
    """Eager rejects the program."""


# --------------------------------------------------------------------------------------------
# Loading and calling
# --------------------------------------------------------------------------------------------

_TMP = tempfile.mkdtemp(prefix="fuser_fuzz_")


def load(program: Program) -> Any:
    """Import the program's source as a module (from a real file, so that tracebacks and
    Dynamo see its lines)."""
    digest = hashlib.sha1(program.source.encode()).hexdigest()[:12]
    name = f"fuzz_program_{digest}"
    path = os.path.join(_TMP, name + ".py")
    with open(path, "w") as f:
        f.write(program.source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _instance(ns: Any, program: Program, dtype: torch.dtype) -> Callable:
    if program.entry == "program":
        return ns.program
    m = ns.Program()
    return m.to(dtype)


def _inputs(ns: Any, call: int, dtype: torch.dtype, grad: bool) -> dict:
    """The call's inputs at ``dtype`` (float64: the own-dtype values, widened), as leaves."""
    nq, nk = ns.CALLS[call]
    base = ns.make_inputs(nq, nk, seed=_seed(ns) * 1000 + call, dtype=ns.DTYPE, call=call)
    out = {}
    for name, x in base.items():
        if x.is_floating_point():
            x = x.to(dtype)
            if grad and name in ns.GRAD_INPUTS:
                x.requires_grad_()
        out[name] = x
    return out


def _seed(ns: Any) -> int:
    return int(getattr(ns, "_FUZZ_SEED", 0))


@dataclasses.dataclass
class _Run:
    """One run of a program (one mode) over the call sequence."""

    fn: Callable
    module: Optional[torch.nn.Module]
    dtype: torch.dtype
    outs: list = dataclasses.field(default_factory=list)
    inputs: list = dataclasses.field(default_factory=list)


def _leaves(inputs: dict, module: Optional[torch.nn.Module]) -> dict:
    leaves = {n: x for n, x in inputs.items() if torch.is_tensor(x) and x.requires_grad}
    if module is not None:
        leaves.update({f"param:{n}": p for n, p in module.named_parameters() if p.requires_grad})
    return leaves


def _grads(out: torch.Tensor, leaves: dict, upstream: torch.Tensor, retain: bool = False) -> dict:
    """Gradients of ``out`` (None where it does not depend on a leaf). ``retain``: keep the
    graph (eager outputs may be differentiated twice; compiled ones must not be)."""
    if not leaves or not out.requires_grad:
        return {n: None for n in leaves}
    got = torch.autograd.grad(out, list(leaves.values()), upstream.to(out.dtype), allow_unused=True,
                              retain_graph=retain)
    return dict(zip(leaves, got))


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------

def rel_err(got: torch.Tensor, want: torch.Tensor, where: Optional[torch.Tensor] = None, floor: float = FLOOR) -> float:
    """max |got - want| / max(max |want|, floor) over ``where`` (default: everywhere)."""
    g, w = got.double(), want.double()
    if where is not None:
        g, w = g[where], w[where]
    if w.numel() == 0:
        return 0.0
    return ((g - w).abs().max() / w.abs().max().clamp_min(floor)).item()


def compare(got: torch.Tensor, want: torch.Tensor, own: Optional[torch.Tensor], dtype: torch.dtype,
            base: dict, *, zero_ok: Optional[torch.Tensor] = None, floor: float = FLOOR,
            ) -> tuple[Optional[str], Optional[str], float]:
    """Compare a fuser value with the float64 oracle ``want`` (``own``: eager at the program's
    dtype, for the tolerance). ``zero_ok``: positions where an exact 0 from fuser is allowed
    (hidden rows). ``floor``: the smallest magnitude errors are relative to. Returns
    ``(kind, detail, err)``: kind ``None`` (equal), ``"nan"`` (a NaN/inf difference) or
    ``"value"``."""
    w_bad = ~torch.isfinite(want)
    gd = got.double()
    g_bad = ~torch.isfinite(gd)
    ok = zero_ok & (gd == 0) if zero_ok is not None else torch.zeros_like(g_bad)
    own_ok = own is not None and tuple(own.shape) == tuple(want.shape)
    # eager at the program's own dtype is not finite either (overflow, 0 * log 0 in float32):
    # a precision effect of the program, not fuser's
    own_bad = g_bad & ~torch.isfinite(own.double()) if own_ok else torch.zeros_like(g_bad)
    # NaN / inf: fuser must agree with eager, except exact zeros where allowed
    same_inf = g_bad & w_bad & (gd == want)
    mism = ((w_bad & ~ok & ~same_inf) | (g_bad & ~w_bad)) & ~own_bad
    if bool(mism.any()):
        idx = tuple(int(i) for i in mism.nonzero()[0])
        return "nan", (f"{int(mism.sum())} position(s) where NaN/inf differ, first at {idx}: "
                       f"fuser {got[idx].item():.6g}, eager {want[idx].item():.6g}"), float("inf")
    cmp = ~w_bad & ~ok & ~own_bad
    err = rel_err(got, want, cmp, floor)
    tol = base[dtype]
    if own_ok:
        fin = cmp & torch.isfinite(own.double())
        if bool((fin == cmp).all()):
            tol = max(tol, SLACK * rel_err(own, want, cmp, floor))
    if err > tol:
        d = (got.double() - want).abs().masked_fill(~cmp, 0)
        idx = tuple(int(i) for i in (d == d.max()).nonzero()[0])
        return "value", (f"max rel. error {err:.3g} > tol {tol:.3g}; worst at {idx}: fuser {got[idx].item():.6g}, "
                         f"eager {want[idx].item():.6g}"), err
    return None, None, err


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------

def fuser_fast(gm, example_inputs, **kwargs):
    """``backend="fuser"`` with Inductor's ``compile_fx`` replaced by AOTAutograd without code
    generation (``aot_eager``): fuser's pass and its ops run exactly as in the backend, but the
    rest of the graph is not compiled to C++ — about 3x faster on a CPU, and blind to bugs in
    the interplay with Inductor's own passes. Use with ``confirm_backend="aot_eager"``."""
    import torch._inductor.compile_fx as cf
    from torch._dynamo.backends.debugging import aot_eager

    from fuser.backend import fuser_backend

    orig = cf.compile_fx
    cf.compile_fx = lambda gm_, ex_, config_patches=None, **_: aot_eager(gm_, ex_)
    try:
        return fuser_backend(gm, example_inputs, **kwargs)
    finally:
        cf.compile_fx = orig


#: backends known to the runner besides the registered ones
BACKENDS = {"fuser_fast": fuser_fast}


class _Sentinel:
    """A local whose death :func:`counting_backend` watches."""


def counting_backend(name: str) -> tuple[Callable, list]:
    """A backend that forwards to the backend ``name`` (registered with Dynamo, or one of
    :data:`BACKENDS`) and records each graph it is given (one entry per compiled graph:
    recompiles and graph breaks both count)."""
    from torch._dynamo import lookup_backend

    inner = BACKENDS[name] if name in BACKENDS else lookup_backend(name)
    graphs: list = []
    frames_left: list = []  # graphs whose compile left the calling frame to the collector

    def compile_graph(gm, example_inputs, kwargs):
        # the caller's frame holds a local whose death is watched: a backend must leave it to
        # reference counting (DDPOptimizer's per-piece guard relies on it; see
        # tests/fuser/test_backend.py::test_the_backend_leaves_its_callers_frames_...)
        sentinel = _Sentinel()
        return inner(gm, example_inputs, **kwargs), weakref.ref(sentinel)

    def backend(gm, example_inputs, **kwargs):
        graphs.append(len(gm.graph.nodes))
        enabled = gc.isenabled()
        gc.disable()  # no collection until the check: only reference counting frees the frame
        try:
            compiled, sentinel = compile_graph(gm, example_inputs, kwargs)
            if sentinel() is not None:
                frames_left.append(len(graphs) - 1)
        finally:
            if enabled:
                gc.enable()
        return compiled

    backend.__name__ = f"counting_{name}"
    backend.frames_left = frames_left

    return backend, graphs


def _between(ns: Any, obj: Any) -> None:
    if hasattr(ns, "between_calls") and isinstance(obj, torch.nn.Module):
        ns.between_calls(obj)


def _grad_ctx(ns: Any):
    return torch.no_grad() if ns.GRAD == "no_grad" else contextlib.nullcontext()


@contextlib.contextmanager
def _plan_env(ns: Any):
    """``FUSER_PLAN`` set to the program's ``FUSER_PLAN`` (a forced plan), if it has one."""
    plan = getattr(ns, "FUSER_PLAN", None)
    if plan is None:
        yield
        return
    old = os.environ.get("FUSER_PLAN")
    os.environ["FUSER_PLAN"] = plan
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FUSER_PLAN", None)
        else:
            os.environ["FUSER_PLAN"] = old


def _count_graphs(ns: Any, program: Program, backend: str) -> tuple[int, Optional[str]]:
    """Graphs ``backend`` compiles over the call sequence (and the error it raised, if any)."""
    torch._dynamo.reset()
    be, graphs = counting_backend(backend)
    inst = _instance(ns, program, ns.DTYPE)
    compiled = torch.compile(inst, backend=be, dynamic=ns.DYNAMIC)
    try:
        for i in range(len(ns.CALLS)):
            if i:
                _between(ns, inst)
            x = _inputs(ns, i, ns.DTYPE, ns.GRAD != "none")
            with _grad_ctx(ns), _plan_env(ns):
                out = compiled(**x)
            del out
    except Exception as exc:  # noqa: BLE001
        return len(graphs), _exc_line(exc)
    finally:
        torch._dynamo.reset()
    return len(graphs), None


def _exc_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception; for Dynamo's wrappers, of the error inside."""
    def first(e: BaseException) -> str:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"

    inner = exc
    while True:
        nxt = getattr(inner, "inner_exception", None) or inner.__cause__
        if nxt is None or nxt is inner:
            break
        inner = nxt
    if inner is not exc:
        return f"{type(exc).__name__} <- {first(inner)}"[:300]
    return first(exc)[:300]


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def run(program: Program, *, backend: str = "fuser", check_recompiles: bool = True,
        confirm_backend: Optional[str] = "inductor", confirm_failures: bool = True) -> Outcome:
    """Compile ``program`` with ``backend`` and compare it with eager (see the module
    docstring). ``backend`` is a registered backend name (tests of this harness pass others).

    A failure is confirmed against ``confirm_backend``: when the same program also fails
    there (any difference, or a crash), the outcome is ``both_fail`` and not counted against
    ``backend`` (e.g. float32 effects of Inductor's own codegen on an unfused program).
    ``confirm_failures=False`` skips that (``confirm_backend`` still counts recompiles)."""
    t0 = time.time()
    out = _check(program, backend, check_recompiles, confirm_backend)
    if (out.status == "fail" and confirm_failures and confirm_backend and confirm_backend != backend
            and out.kind not in ("recompile", "internal")):
        ref = _check(program, confirm_backend, False, None)
        if ref.status in ("fail", "both_fail"):
            out.status = "both_fail"
            out.reason = f"{confirm_backend} fails too: {ref.failures[0] if ref.failures else ref.reason}"
            out.compiles.update(ref.compiles)
    if out.status == "fail" and program.mask_buffer and program.spec.between == "mask_buffer_fill":
        out.allowed.append("mask_buffer_mutated")
        out.status, out.reason = "pass", f"documented: mask buffer mutated between calls ({out.failures[0]})"
        out.failures = []
    out.seconds = time.time() - t0
    return out


def _check(program: Program, backend: str, check_recompiles: bool, confirm_backend: Optional[str]) -> Outcome:
    out = Outcome(program)
    ns = load(program)
    ns._FUZZ_SEED = program.spec.seed
    try:
        _run(ns, program, out, backend, check_recompiles, confirm_backend)
    except _Discard as exc:
        out.status, out.reason, out.failures = "discard", str(exc), []
    finally:
        torch._dynamo.reset()
    if out.status == "pass" and out.failures:
        out.status = "fail"
    return out


def _eager_backward_ok(a: Any, x: dict, own: Any) -> None:
    """Raise :class:`_Discard` when eager's backward of ``a`` fails (e.g. an input it saved was
    written in place): compiling traces the backward early, so it fails at compile time."""
    leaves = _leaves(x, own if isinstance(own, torch.nn.Module) else None)
    if torch.is_tensor(a) and a.requires_grad and leaves:
        try:
            torch.autograd.grad(a, list(leaves.values()), torch.ones_like(a), allow_unused=True, retain_graph=True)
        except Exception as exc:  # noqa: BLE001
            raise _Discard(f"eager backward raises {_exc_line(exc)}") from None


def _eager_call(fn: Callable, x: dict, ns: Any, what: str) -> torch.Tensor:
    try:
        with _grad_ctx(ns):
            return fn(**x)
    except Exception as exc:  # noqa: BLE001
        raise _Discard(f"eager ({what}) raises {_exc_line(exc)}") from None


def _run(ns: Any, program: Program, out: Outcome, backend: str, check_recompiles: bool, confirm_backend: str) -> None:
    spec = program.spec
    dtype = ns.DTYPE
    grad = ns.GRAD != "none"
    kl = spec.is_kl
    # persistent instances: own dtype, float64 oracle, the -inf and -1e300 fill variants, fuser
    own = _instance(ns, program, dtype)
    ref = _instance(load(program.variant()), program, torch.float64)  # float32 pins removed
    variants = {}
    fills = ("-inf", "-1e300") if program.hides_rows and not kl else ("-1e300",) if kl else ()
    for fill in fills:
        # attention-KL's limit oracle: -inf fills become -1e300 (0 * log 0 terms of fully hidden
        # keys), a finite fill stays what it is (it is a value: replacing it by -1e300 would hide
        # keys that eager weighs); log(softmax) is written log_softmax either way
        limit_fill = None if kl and spec.fill != "-inf" else fill
        vns = load(program.variant(limit_fill, stable=kl))
        vns._FUZZ_SEED = spec.seed
        variants[fill] = (vns, _instance(vns, program, torch.float64))
    if spec.softmax == "hand_nomax" and not kl:
        vns = load(program.variant(with_max=True))
        vns._FUZZ_SEED = spec.seed
        variants["with_max"] = (vns, _instance(vns, program, torch.float64))
    inst = _instance(ns, program, dtype)
    torch._dynamo.reset()
    be, graphs = counting_backend(backend)
    compiled = torch.compile(inst, backend=be, dynamic=ns.DYNAMIC)
    with collecting() as rep:
        for i in range(len(ns.CALLS)):
            if i:
                for obj in (own, ref, inst, *(v for _, v in variants.values())):
                    _between(ns, obj)
            x_own = _inputs(ns, i, dtype, grad)
            x_ref = _inputs(ns, i, torch.float64, grad)
            x_fus = _inputs(ns, i, dtype, grad)
            a = _eager_call(own, x_own, ns, str(dtype).replace("torch.", ""))
            try:
                with _grad_ctx(ns):
                    w = ref(**x_ref)
            except Exception:  # noqa: BLE001 - not dtype-generic: the own-dtype run is the oracle
                w = None
            vout = {}
            for fill, (vns, vinst) in variants.items():
                xv = _inputs(vns, i, torch.float64, grad)
                try:
                    with _grad_ctx(ns):
                        vout[fill] = (vinst(**xv), xv, vinst)
                except Exception:  # noqa: BLE001
                    pass
            try:
                with _grad_ctx(ns), _plan_env(ns):
                    c = compiled(**x_fus)
            except Exception as exc:  # noqa: BLE001
                _eager_backward_ok(a, x_own, own)  # eager would fail later, in its backward?
                out.failures.append(Failure("crash", i, f"forward: {_exc_line(exc)}"))
                break
            if not (torch.is_tensor(a) and torch.is_tensor(c)):
                raise _Discard("the program does not return a tensor")
            if w is None:  # the float64 program raises: eager at the own dtype is the oracle
                w, x_ref, ref_mod = a.double(), x_own, own
                out.allowed.append("no_float64_oracle")
            else:
                ref_mod = ref
            if not _check_call(i, a, w, c, x_own, x_ref, x_fus, own, ref_mod, inst, vout, program, out, dtype, kl):
                break
    out.fused = len(rep.fused)
    out.declined = [r.reason for r in rep.rejected] + [m.reason for m in rep.matches if not m.fused]
    internal = [r for r in out.declined if r.startswith("internal error")]
    if internal and not out.failures:
        # a pattern that raised while matching or rewriting (the pass left the region to Inductor
        # and warned): the result is right, but the pattern has a bug
        out.failures.append(Failure("internal", -1, internal[0][:300]))
    if be.frames_left and backend.startswith("fuser") and not out.failures:
        out.failures.append(Failure("internal", -1, f"compiling graph {be.frames_left[0]} left the frame that "
                                    "called the backend alive in a reference cycle (freed only by a later "
                                    "collection: DDPOptimizer relies on reference counting there)"))
    out.compiles[backend] = len(graphs)
    torch._dynamo.reset()
    if check_recompiles and not out.failures and len(ns.CALLS) > 1:
        mine = len(graphs)
        n, err = _count_graphs(ns, program, "aot_eager")
        out.compiles["aot_eager"] = n
        if (mine > n or err is not None) and confirm_backend:
            n, err = _count_graphs(ns, program, confirm_backend)
            out.compiles[confirm_backend] = n
            if err is None and mine > n:
                out.failures.append(Failure("recompile", -1, f"{backend} compiled {mine} graph(s) over calls "
                                            f"{list(ns.CALLS)} (dynamic={ns.DYNAMIC}), {confirm_backend} {n}"))


def _check_call(i, a, w, c, x_own, x_ref, x_fus, own, ref, inst, vout, program, out, dtype, kl) -> bool:
    """Compare call ``i``; returns False when the sequence should stop (a failure)."""
    spec = program.spec
    if tuple(c.shape) != tuple(a.shape):
        out.failures.append(Failure("shape", i, f"fuser {tuple(c.shape)}, eager {tuple(a.shape)}"))
        return False
    if c.dtype != a.dtype:
        out.failures.append(Failure("dtype", i, f"fuser {c.dtype}, eager {a.dtype}"))
        return False
    w_out, w = w, w.detach()
    ad = a.detach().double()
    if ad.shape == w.shape:
        # not dtype-generic at these positions (e.g. finfo(float64).min cast to float32 is
        # -inf): eager at the program's own dtype is finite where float64 is not; it is the oracle
        w = torch.where(~torch.isfinite(w) & torch.isfinite(ad), ad, w)
    if "with_max" in vout and not bool(torch.isfinite(w).all()):
        # exp(s) / exp(s).sum() without the max: 0 / 0 where a row's exps all underflow, which
        # fuser computes as the softmax it is (README, Limits): compared with the max subtracted
        wm = vout["with_max"][0].detach()
        if wm.shape == w.shape:
            swap = ~torch.isfinite(w) & torch.isfinite(wm)
            if bool(swap.any()):
                w = torch.where(swap, wm, w)
                out.allowed.append("nomax_underflow")
    nan_w = torch.isnan(w)
    w_cmp, zero_ok, hidden = w, None, None
    if kl and "-1e300" in vout and bool(nan_w.any()):
        # 0 * (-inf) in eager's KL terms (-inf fills, or log(softmax) underflowing to log 0):
        # compare with the limit, eager's program with -1e300 fills and log_softmax
        fin = vout["-1e300"][0].detach()
        if fin.shape == w.shape:
            w_cmp = torch.where(nan_w, fin, w)
            out.allowed.append("kl_nan_limit")
    elif not kl and "-inf" in vout:
        hidden = torch.isnan(vout["-inf"][0].detach())  # rows with no visible key
        if hidden.shape == w.shape:
            # NaN in eager (-inf fills) or documented finite fills: fuser's 0 is allowed there;
            # additive finite masks must give eager's value (README)
            zero_ok = hidden & nan_w if not program.documented_fill else hidden
        else:
            hidden = None
    kind, detail, _ = compare(c.detach(), w_cmp, a.detach(), dtype, BASE_TOL, zero_ok=zero_ok)
    if kind is not None:
        out.failures.append(Failure("forward_nan" if kind == "nan" else "forward", i, detail))
        return False
    if zero_ok is not None:
        zeros = zero_ok & (c.detach().double() == 0)
        if bool((zeros & nan_w).any()):
            out.allowed.append("nan_row_zero")
        if bool((zeros & ~nan_w & (c.detach().double() != w)).any()):
            out.allowed.append("finite_fill_row_zero")

    # gradients
    leaves_f = _leaves(x_fus, inst if isinstance(inst, torch.nn.Module) else None)
    leaves_r = _leaves(x_ref, ref if isinstance(ref, torch.nn.Module) else None)
    leaves_o = _leaves(x_own, own if isinstance(own, torch.nn.Module) else None)
    if leaves_r and (w_out.requires_grad or c.requires_grad):
        if w_out.requires_grad != c.requires_grad:
            out.failures.append(Failure("grad_presence", i, f"output requires_grad: fuser {c.requires_grad}, "
                                        f"eager {w_out.requires_grad}"))
            return False
        g = torch.Generator().manual_seed(spec.seed * 7919 + i)
        up = torch.randn(w.shape, generator=g, dtype=torch.float64)
        if hidden is not None:
            # rows with no visible key get no upstream gradient: README promises exact
            # gradients under that condition only (padded positions in a masked loss)
            up = up.masked_fill(hidden, 0.0)
        try:
            gw = _grads(w_out, leaves_r, up, retain=True)
            go = _grads(a, leaves_o, up, retain=True)
        except Exception as exc:  # noqa: BLE001
            raise _Discard(f"eager backward raises {_exc_line(exc)}") from None
        if any(t is not None and not bool(torch.isfinite(t).all()) for t in gw.values()) and "-1e300" in vout:
            # eager's backward is NaN through -inf fills: the -1e300 program is the oracle
            fo, fx, finst = vout["-1e300"]
            try:
                gw = _grads(fo, _leaves(fx, finst if isinstance(finst, torch.nn.Module) else None), up, retain=True)
                out.allowed.append("grad_oracle_nan")
            except Exception:  # noqa: BLE001
                pass
        try:
            gc = _grads(c, leaves_f, up)
        except Exception as exc:  # noqa: BLE001
            out.failures.append(Failure("crash", i, f"backward: {_exc_line(exc)}"))
            return False
        # errors are relative to the largest gradient of the call (at least 1/10 of it, and
        # GRAD_FLOOR): a gradient that cancels to ~0 in exact arithmetic (saturated softmax)
        # keeps float32 rounding noise in any other summation order
        floor = max([GRAD_FLOOR] + [0.1 * t[torch.isfinite(t)].abs().max().item() for t in gw.values()
                                    if t is not None and bool(torch.isfinite(t).any())])
        for name in leaves_r:
            tw, tc, to = gw.get(name), gc.get(name), go.get(name)
            if (tw is None) != (tc is None):
                out.failures.append(Failure("grad_presence", i, f"grad of {name}: fuser {'None' if tc is None else 'a tensor'}, "
                                            f"eager {'None' if tw is None else 'a tensor'}"))
                return False
            if tw is None:
                continue
            fin = torch.isfinite(tw)
            if bool(fin.all()):
                kind, detail, _ = compare(tc, tw, to, dtype, BASE_GRAD_TOL, floor=floor)
            else:
                # no finite oracle: compare where eager's gradient is finite
                out.allowed.append("grad_oracle_nan")
                kind, detail, _ = compare(tc[fin], tw[fin], to[fin] if to is not None else None, dtype, BASE_GRAD_TOL,
                                          floor=floor)
            if kind is not None:
                out.failures.append(Failure("grad_nan" if kind == "nan" else "grad", i, f"grad of {name}: {detail}"))
                return False

    # side effects: inputs and module state after the call
    for name in x_ref:
        xr, xf, xo = x_ref[name], x_fus[name], x_own[name]
        if not torch.is_tensor(xr):
            continue
        if xr.is_floating_point():
            kind, detail, _ = compare(xf.detach(), xr.detach().double(), xo.detach(), dtype, BASE_TOL)
        else:
            kind, detail = (None, None) if torch.equal(xf, xr) else ("value", "values differ")
        if kind is not None:
            out.failures.append(Failure("mutation", i, f"input {name} after the call: {detail}"))
            return False
    if isinstance(inst, torch.nn.Module) and isinstance(ref, torch.nn.Module):
        sr, sf = ref.state_dict(), inst.state_dict()
        so = own.state_dict() if isinstance(own, torch.nn.Module) else {}
        for name, tr in sr.items():
            tf = sf[name]
            if tr.is_floating_point():
                kind, detail, _ = compare(tf.detach(), tr.detach().double(), so.get(name), dtype, BASE_TOL)
            else:
                kind, detail = (None, None) if torch.equal(tf, tr) else ("value", "values differ")
            if kind is not None:
                out.failures.append(Failure("mutation", i, f"module state {name} after the call: {detail}"))
                return False
    return True


def format_failure(outcome: Outcome, header: str = "") -> str:
    """A failing program as text: its source (runnable), and what differed."""
    lines = [header] if header else []
    lines.append(outcome.program.source.rstrip())
    lines.append("")
    lines.append("# " + outcome.summary().replace("\n", "\n# "))
    return "\n".join(lines) + "\n"


REPRO_DRIVER = '''

if __name__ == "__main__":
    # Reproduce: eager (float64 oracle) against backend="fuser", call by call.
    import fuser  # noqa: F401
    make = (lambda: Program().to(DTYPE)) if "Program" in globals() else (lambda: program)
    eager, ref = make(), ((lambda: Program().double()) if "Program" in globals() else (lambda: program))()
    compiled = torch.compile(make(), backend="fuser", dynamic=DYNAMIC)
    ctx = torch.no_grad if GRAD == "no_grad" else torch.enable_grad
    for i, (n_q, n_k) in enumerate(CALLS):
        x = make_inputs(n_q, n_k, seed=SEED * 1000 + i, dtype=DTYPE, call=i)
        xr = {n: (t.double() if t.is_floating_point() else t) for n, t in x.items()}
        if i and "between_calls" in globals():
            for m in (ref, compiled._orig_mod if hasattr(compiled, "_orig_mod") else compiled):
                between_calls(m)
        with ctx():
            want, got = ref(**xr), compiled(**x)
        print(f"call {i} (n_q={n_q}, n_k={n_k}): max |fuser - eager| = {(got.double() - want).abs().max().item():.3g}, "
              f"NaN fuser/eager = {int(got.isnan().sum())}/{int(want.isnan().sum())}")
'''


def repro_script(outcome: Outcome) -> str:
    """The failing program as a standalone script: source, the failure as comments, and a
    small driver comparing eager (float64) with ``backend="fuser"`` call by call (forward only;
    the runner's full checks are in :mod:`tests.soundness.runner`)."""
    return format_failure(outcome) + f"\nSEED = {outcome.program.spec.seed}\n" + REPRO_DRIVER
