"""KDA benchmark: Kimi Delta Attention, fuser's kernels against the PyTorch loop, Inductor and FLA.

Usage (on a GPU; one process measures everything side by side)::

    python benchmarks/kda.py --shapes blog long --cudagraphs --out-dir "$OUT"   # kernel-blog + long-T shapes
    python benchmarks/kda.py --shapes train --out-dir "$OUT"                     # training shapes, fwd + fwd+bwd
    python benchmarks/kda.py --smoke                                             # tiny sizes; CPU (interpreter)

What is measured (issue 10, part C): KDA (``patterns/kda_reference.py`` has the math and the
float64 oracles) on q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H, K]`` (log-space
decay), beta ``[B, T, H]``, scale = K^-0.5, no initial state, the final state returned; the
user's spelling is the kernel blogs' loop (``benchmarks/kda_trace_time.py``'s ``blog_loop``)
taking FLA's ``[B, T, H, K]`` layout, upcasting each step's slices to float32 and returning
``(o, final state)``::

    s = q.new_zeros(B, H, K, V, dtype=torch.float32); o = torch.empty_like(v)
    for t in range(T):
        q_t, k_t, v_t, g_t, b_t = (x[:, t].float() for x in (q, k, v, g, beta))
        s = s * g_t[..., None].exp()
        v_hat = (k_t[..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, v_t - v_hat)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q_t * scale, s)
    return o, s

Inputs (``--dtype``, default bf16): q, k = l2-normalised ``randn`` (over K), v = ``randn``,
beta = ``sigmoid(randn)``, all in ``--dtype``; g = ``-softplus(randn)`` in ``--gate-dtype``
(default **fp32**, as FLA's gate kernels produce it; ``bf16`` to store it like q); the state is
float32. fwdbwd: q, k, v, g, beta require grad; the gradient flows from o alone (``do`` = a
fixed ``randn``; the final state is returned but gets no gradient).

Shapes (``--shapes``, any of ``blog long train all``; default all):

- ``blog``: the kernel blogs' decode-like shapes, B=1, T=8, H=2, (K, V) in (256, 8192),
  (512, 16384), (8192, 1024), (16384, 1024); forward.
- ``long``: T = 64, 512 at B=1, H=2, K=256, V=8192; forward.
- ``train``: B=1, T=``--train-t`` (4096), H=16, K = V in ``--train-dims`` (64 128 256); forward
  and forward+backward (``--mode fwd|fwdbwd|both``, default both).

Implementations (``--impls``; default all), in run order per configuration:

- ``fuser``: ``torch.compile(loop, backend="fuser", dynamic=False)``, compiled per
  configuration; the plan fuser chose (its report around the compiling call) is in the note and
  the ``plan`` field (``†``: the loop was not fused). Skipped above T = ``--fuser-loop-max-t``
  (1024): Dynamo unrolls the loop, capture alone takes ~22 ms a token.
- ``fuser_op``: the same computation without the loop: ``torch.ops.fuser.kda(...)`` called
  directly with the arguments ``patterns/kda.py``'s emit passes for this loop (the inputs as
  they are, time dim 1, ``out_dtype`` = v's dtype, the final state wanted in float32) and the
  plan the cost model picks (``patterns/kda_plans.candidates`` on the same shapes: the cheapest
  fuser plan; the note says when the planner would rather leave it to Inductor). Measures
  fuser's kernels plus its host path (layout copies, reshapes) at every shape, also where the
  loop cannot be captured. fwdbwd: the op's autograd (whatever backward ``kda_ops`` runs: the
  float64 reference until ``codegen/kda_bwd.py`` is wired in).
- ``fuser[recurrent]``, ``fuser[chunk]``, ``fuser[parallel]`` (``--impls fuser_recurrent
  fuser_chunk fuser_parallel``): the kernel modules called directly, ``codegen/kda_recurrent.forward``
  / ``codegen/kda_chunk.forward (chunk=64)`` / ``codegen/kda_parallel.forward`` (T <= 64 only), on inputs flattened to ``[B·H, T, *]`` before the timed region; fwdbwd adds
  ``codegen/kda_bwd.backward(..., chunk=64)`` (the same chunked backward after either
  forward). A module that is not there yet is recorded ``unavailable``.
- The chunk forward's dots (``codegen/kda_chunk.py``, "Precision of the dots"; :data:`CHUNK_ROWS`):
  ``fuser[chunk]`` runs its defaults (output-path dots ``A_qk``, ``Qg S``, ``A_qk Δ`` single-pass
  TF32 for a bfloat16 o, else ``tf32x3`` like the state path's); ``fuser[chunk o=tf32]``
  (``--impls fuser_chunk_tf32``) forces TF32 on the output path, ``fuser[chunk o=tf32x3]``
  (``fuser_chunk_tf32x3``) float32-class ``tf32x3`` dots everywhere, ``fuser[chunk dots=bf16]``
  (``fuser_chunk_bf16``) bfloat16 workspaces and dots (FLA's precision class). Their err columns
  show what each costs in accuracy. The compiled loop takes the same choices through
  ``--fuser-option fuser.plan=kda.plan=chunk,kda.output_precision=tf32x3`` (or ``kda.dots=bfloat16``).
- ``fla_recurrent``: ``fla.ops.kda.fused_recurrent_kda`` (FLA 0.6.0), forward only (it has no
  backward: fwdbwd rows read skip); never run at K >= 8192, where its Triton compile hangs for
  minutes (skip, measured). ``fla_chunk``: ``fla.ops.kda.chunk_kda`` (fwd, and its autograd in
  fwdbwd); its refusals (it asserts K <= 256) are recorded as the error they raise. Both need
  ``import fla`` to work and a GPU, else ``unavailable``.
- ``eager``: the loop, plain PyTorch.
- ``inductor``: ``torch.compile(loop, dynamic=False)``; skipped above T = ``--inductor-max-t``
  (512): its compile of the unrolled loop takes minutes.
- ``--cudagraphs`` adds, at the blog shapes, ``fuser[cg]`` and ``inductor[cg]``: the same
  compiles with ``mode="reduce-overhead"`` (CUDA graphs; ``torch.compiler.cudagraph_mark_step_begin()``
  before every call). CUDA only (skip on the CPU).

Measurement per (configuration, impl), by the driver in ``common.py``: synchronize; a first call
(host clock, compilation included: ``first call s``), checked; one call probing memory (``extra
MiB``: peak allocated during it minus what was allocated before: outputs and temporaries, not
inputs); then ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")`` (``--timing
cudagraph``: ``do_bench_cudagraph``, the calls replayed from one CUDA graph: GPU time alone, without the
host time that a host-bound call reads under events; the ``[cg]`` rows stay on events). Every
configuration compiles afresh (new code objects, ``torch._dynamo.reset()`` after it). Any
exception is recorded (``OOM``, ``err: ...``) and the run goes on; the tables are rewritten after
every measurement, and ``--budget-s`` (default 450) stops starting new measurements (a
measurement under way, e.g. Inductor compiling T=512, runs on: bound the command with ``timeout``
too; what was written stays).

Correctness: o and the final state of every impl (and in fwdbwd the gradients of q, k, v, g,
beta) against float64 references on the same inputs: ``kda_reference.recurrent`` up to T =
``--ref-recurrent-max-t`` (512), ``kda_reference.chunked`` (chunks of 64, the exact WY form, also
float64; equal to the recurrence up to float64 rounding) above, on the device; fwdbwd by
autograd through them, a few heads at a time. ``err`` = ‖x − ref‖ / ‖ref‖ (o / state / worst
gradient); above 2e-2 (bf16, fp16; 1e-3 fp32) reads ``WRONG`` (exit status 1 when a fuser row is;
``fuser[chunk dots=bf16]``, bfloat16 dots by choice, is held to 2e-2 whatever the dtype).

Floor: the bytes a kernel must move at least, at ``--peak-tbps`` (3.0 TB/s, measured on the
H100): fwd = q, k, v, g, beta read once + o written (v's dtype) + the final state written
(float32); fwdbwd adds the backward's least traffic: the inputs and do read again, dq, dk, dv, dg,
dbeta written. ``x floor`` = time / floor.

Columns of the main table (``benchmarks/results/kda.md``): ``set, T, H, K, V, mode``; one time
column per impl (median ms; ``skip``, ``unavailable``, ``OOM``, ``err``: see the details table;
``†`` the loop was not fused; ``WRONG``); ``floor ms``; ``fuser`` (the headline fuser row: the
compiled loop where it ran, else ``fuser_op``); its ``x floor``, ``vs inductor`` and ``vs best
FLA`` (other time / fuser time: > 1 = fuser faster); its ``err o / state / grads``. The details
table has one row per (configuration, impl): ms, x floor, vs inductor, vs best FLA (for that
impl), extra MiB, first call s, err, note. The plot (``kda.png``): time against T (the x axis
reads N), one panel per (H, K, V, mode).

Flags: ``--shapes``, ``--mode``, ``--train-t``, ``--train-dims``, ``--impls``, ``--cudagraphs``, ``--timing``,
``--dtype``, ``--gate-dtype``, ``--fuser-loop-max-t``, ``--inductor-max-t``,
``--ref-recurrent-max-t``, ``--check {auto,none}``, ``--peak-tbps``, ``--warmup``/``--rep``
(do_bench ms, 10/50), ``--budget-s``, ``--out``, ``--out-dir`` (or env ``FUSER_BENCH_OUT_DIR``),
``--fuser-option key=value``, ``--device``, ``--seed``, ``--smoke`` (B=1, T=5, H=2, K=12, V=20,
fp32, fwd and fwdbwd; results to ``kda_smoke.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import types
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

#: ``--impls`` names -> record names, in run order (the subject first; Inductor, the slowest
#: compile, last so a long compile cannot starve the others).
IMPLS = {
    "fuser": "fuser", "fuser_op": "fuser_op", "fuser_recurrent": "fuser[recurrent]", "fuser_chunk": "fuser[chunk]",
    "fuser_chunk_tf32": "fuser[chunk o=tf32]", "fuser_chunk_tf32x3": "fuser[chunk o=tf32x3]",
    "fuser_chunk_bf16": "fuser[chunk dots=bf16]",
    "fuser_parallel": "fuser[parallel]", "fla_recurrent": "fla_recurrent", "fla_chunk": "fla_chunk", "eager": "eager", "inductor": "inductor",
}
#: The chunk rows: ``codegen/kda_chunk.forward``'s arguments beyond the defaults (the dots' precision:
#: its docstring, "Precision of the dots"). ``fuser[chunk]``: the defaults (output-path dots TF32 for a
#: bfloat16 o, else the state path's ``tf32x3``); ``o=tf32``: output-path dots single-pass TF32 whatever
#: o is; ``o=tf32x3``: float32-class dots everywhere (the default before the output path was split off);
#: ``dots=bf16``: bfloat16 workspaces and dots, FLA's precision class (the state ~2e-3 off).
CHUNK_ROWS = {
    "fuser[chunk]": {}, "fuser[chunk o=tf32]": {"output_precision": "tf32"},
    "fuser[chunk o=tf32x3]": {"output_precision": "tf32x3"}, "fuser[chunk dots=bf16]": {"dots": "bfloat16"},
}
CUDAGRAPH_IMPLS = ("fuser[cg]", "inductor[cg]")
FUSER_ROWS = ("fuser", "fuser_op", "fuser[recurrent]", *CHUNK_ROWS, "fuser[parallel]", "fuser[cg]")
FLA_ROWS = ("fla_recurrent", "fla_chunk")
COLUMN_ORDER = ("eager", "inductor", "inductor[cg]", "fuser", "fuser[cg]", "fuser_op", "fuser[recurrent]",
                *CHUNK_ROWS, "fuser[parallel]", "fla_recurrent", "fla_chunk")
WRONG_TOL = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-3}
BLOG_KV = ((256, 8192), (512, 16384), (8192, 1024), (16384, 1024))
LONG_T = (64, 512)
CHUNK = 64
#: fused_recurrent_kda's Triton compile hangs for minutes from this K (measured on the H100).
FLA_RECURRENT_HANG_K = 8192
UNAVAILABLE = "unavailable: "


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=("blog", "long", "train", "all"), default=["all"],
                   help="shape sets (default all)")
    p.add_argument("--mode", choices=("fwd", "fwdbwd", "both"), default="both",
                   help="training shapes: forward, forward+backward or both (blog and long: forward)")
    p.add_argument("--train-t", type=int, default=4096, help="T of the training shapes (default %(default)s)")
    p.add_argument("--train-dims", type=int, nargs="+", default=[64, 128, 256],
                   help="K = V of the training shapes (default 64 128 256)")
    p.add_argument("--impls", nargs="+", choices=tuple(IMPLS), default=list(IMPLS))
    p.add_argument("--cudagraphs", action="store_true",
                   help="add fuser[cg] and inductor[cg] (mode=reduce-overhead) at the blog shapes")
    p.add_argument("--timing", choices=common.TIMINGS, default="events",
                   help="events: do_bench (a host-bound call reads its host time); cudagraph: "
                        "do_bench_cudagraph, the calls captured in one CUDA graph and replayed (device time "
                        "only; [cg] rows stay on events)")
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None,
                   help="q, k, v, beta (and o) dtype: default bf16 (fp32 with --smoke)")
    p.add_argument("--gate-dtype", choices=tuple(common.DTYPES), default="fp32", help="g's dtype (default fp32)")
    p.add_argument("--fuser-loop-max-t", type=int, default=1024,
                   help="skip the compiled loop (fuser) above this T (default %(default)s)")
    p.add_argument("--inductor-max-t", type=int, default=512,
                   help="skip Inductor above this T (default %(default)s)")
    p.add_argument("--ref-recurrent-max-t", type=int, default=512,
                   help="float64 recurrent reference up to this T, float64 chunked above (default %(default)s)")
    p.add_argument("--check", choices=("auto", "none"), default="auto", help="none: no reference, no errors")
    p.add_argument("--peak-tbps", type=float, default=3.0, help="HBM TB/s for the floor (default %(default)g, "
                   "measured on the H100)")
    common.add_driver_args(p, budget_s=450.0, warmup=10, rep=50, out_name="kda")
    a = p.parse_args(argv)
    common.finish_driver_args(a, out_name="kda", warmup=10, rep=50)
    a.dtype = a.dtype or ("fp32" if a.smoke else "bf16")
    a.sets = ["blog", "long", "train"] if "all" in a.shapes else [s for s in ("blog", "long", "train") if s in a.shapes]
    a.modes = ["fwd", "fwdbwd"] if a.mode == "both" else [a.mode]
    a.impl_list = [IMPLS[i] for i in IMPLS if i in a.impls]
    a.tol = WRONG_TOL[a.dtype]
    return a


# --------------------------------------------------------------------------------------------
# the loop, the reference
# --------------------------------------------------------------------------------------------

def kda_loop(q, k, v, g, beta):
    """KDA as users write it (the kernel blogs' loop on FLA's ``[B, T, H, K]`` layout): returns
    ``(o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32)``."""
    import torch

    b, t_len, h, kd = q.shape
    scale = kd ** -0.5
    s = q.new_zeros(b, h, kd, v.shape[-1], dtype=torch.float32)
    o = torch.empty_like(v)
    for t in range(t_len):
        q_t, k_t, v_t = q[:, t].float(), k[:, t].float(), v[:, t].float()
        g_t, b_t = g[:, t].float(), beta[:, t].float()
        s = s * g_t[..., None].exp()
        v_hat = (k_t[..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, v_t - v_hat)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q_t * scale, s)
    return o, s


@dataclasses.dataclass
class Config:
    set: str
    b: int
    t: int
    h: int
    kd: int
    vd: int
    mode: str = "fwd"

    @property
    def label(self) -> str:
        return f"{self.set} T={self.t} H={self.h} K={self.kd} V={self.vd} {self.mode}"

    @property
    def n(self) -> int:
        return self.b * self.h


@dataclasses.dataclass
class Inputs:
    q: Any
    k: Any
    v: Any
    g: Any
    beta: Any
    do: Any = None
    flat: Optional[tuple] = None

    @property
    def args(self) -> tuple:
        return self.q, self.k, self.v, self.g, self.beta


def min_bytes(cfg: Config, esize: int, gsize: int) -> float:
    """Least HBM traffic (see the module docstring): fwd, plus the backward's in fwdbwd."""
    n, t, kd, vd = cfg.n, cfg.t, cfg.kd, cfg.vd
    inputs = n * t * (2 * kd * esize + vd * esize + kd * gsize + esize)
    fwd = inputs + n * t * vd * esize + n * kd * vd * 4
    if cfg.mode == "fwdbwd":
        fwd += 2 * inputs + n * t * vd * esize
    return float(fwd)


def reference(inp: Inputs, cfg: Config, recurrent_max_t: int, with_grads: bool, budget_bytes: float) -> tuple:
    """``(o, state[, dq, dk, dv, dg, dbeta])`` in float64 from ``kda_reference`` (recurrent up to
    ``recurrent_max_t``, chunked above), heads sliced so autograd's saved tensors stay within
    ``budget_bytes``."""
    import torch

    from fuser.patterns import kda_reference as ref

    use_rec = cfg.t <= recurrent_max_t
    scale = cfg.kd ** -0.5

    def run(q, k, v, g, beta):
        if use_rec:
            return ref.recurrent(q, k, v, g, beta, scale=scale, output_final_state=True)
        return ref.chunked(q, k, v, g, beta, scale=scale, output_final_state=True, chunk=CHUNK)

    args = [x.detach() for x in inp.args]
    if not with_grads:
        with torch.no_grad():
            return run(*args)
    # autograd keeps ~8 float64 copies of the per-step (recurrent) or per-chunk (chunked) tensors
    per_head = 64.0 * cfg.t * (cfg.kd * cfg.vd if use_rec else (CHUNK * cfg.kd + cfg.kd * cfg.vd / CHUNK))
    step = max(1, min(cfg.h, int(budget_bytes // max(per_head, 1.0))))
    outs = None
    for h0 in range(0, cfg.h, step):
        hs = slice(h0, min(cfg.h, h0 + step))
        leaves = [x[:, :, hs].double().requires_grad_(True) for x in args]
        with torch.enable_grad():
            o, s = run(*leaves)
            grads = torch.autograd.grad(o, leaves, inp.do[:, :, hs].double())
        part = (o.detach(), s.detach(), *grads)
        if outs is None:
            outs = [torch.empty(x.shape[:2] + (cfg.h,) + x.shape[3:], dtype=x.dtype, device=x.device)
                    if i != 1 else torch.empty((x.shape[0], cfg.h) + x.shape[2:], dtype=x.dtype, device=x.device)
                    for i, x in enumerate(part)]
        for i, x in enumerate(part):
            if i == 1:
                outs[i][:, hs] = x
            else:
                outs[i][:, :, hs] = x
        del part, leaves, o, s, grads
    return tuple(outs)


def rel_errs(got: tuple, ref: tuple) -> dict:
    """``{"o", "state", "grads", "worst"}``: ‖x − ref‖ / ‖ref‖ (NaN if not finite; None where the
    impl has no such output)."""
    o = common.rel_err(got[:1], ref[:1])
    state = common.rel_err(got[1:2], ref[1:2]) if len(got) > 1 and got[1] is not None else None
    grads = common.rel_err(got[2:], ref[2:]) if len(got) > 2 and len(ref) > 2 else None
    parts = [e for e in (o, state, grads) if e is not None]
    worst = float("nan") if any(math.isnan(e) for e in parts) else max(parts)
    return {"o": o, "state": state, "grads": grads, "worst": worst}


# --------------------------------------------------------------------------------------------
# the modules that may not exist yet
# --------------------------------------------------------------------------------------------

def optional_module(name: str, attr: Optional[str] = None) -> tuple[Optional[types.ModuleType], str]:
    """``(module, "")``, or ``(None, why)`` when it cannot be imported or lacks ``attr``."""
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a missing kernel is a result, not a failure
        return None, f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    if attr is not None and not callable(getattr(mod, attr, None)):
        return None, f"{name} has no {attr}() yet"
    return mod, ""


def fla_ops() -> tuple[Optional[types.ModuleType], str]:
    """``fla.ops.kda`` or why not (FLA not installed, or its import failing)."""
    return optional_module("fla.ops.kda")


def planner_choice(inp: Inputs, cfg: Config, out_dtype) -> tuple[str, str, str]:
    """``(plan string for torch.ops.fuser.kda, plan name, note)``: the cheapest fuser plan of
    ``patterns/kda_plans.candidates`` for this loop's match at these shapes (a stand-in match
    with the bindings ``patterns/kda.py`` would find: ``kda_plans.stand_in_match``)."""
    from fuser.patterns import kda_ops

    try:
        from fuser.patterns import kda_plans

        match = kda_plans.stand_in_match(cfg.b * cfg.h, cfg.t, cfg.kd, cfg.vd, dtype=inp.q.dtype, gate_dtype=inp.g.dtype,
                                         out_dtype=out_dtype, device=inp.q.device, lead=(cfg.b, cfg.h))
        from fuser.options import Options

        cands = kda_plans.candidates(match, types.SimpleNamespace(options=Options()))  # default options
        fz = [c for c in cands if c.params.get("impl") == "fuser"]
        best = min(fz, key=lambda c: c.estimate_ms)
        overall = min(cands, key=lambda c: c.estimate_ms)
        note = f"op plan {best.name} (cost model, est. {best.estimate_ms:.3g} ms)"
        if overall is not best:
            note += f"; the planner would pick {overall.name} (est. {overall.estimate_ms:.3g} ms)"
        return best.params["plan_string"], best.name, note
    except Exception as exc:  # noqa: BLE001 - the op still runs, with the recurrent plan
        return kda_ops.plan_string("recurrent"), "fuser[recurrent]", f"op plan fuser[recurrent] (cost model failed: {common.short_error(exc)})"


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------

class KDABenchmark(common.Benchmark):
    """Groups: (shape set, mode); every configuration compiles its own functions."""

    title = "fuser KDA benchmark"
    name = "KDA"
    label_width = 40
    reference_label = "float64 reference"

    def __init__(self, args) -> None:
        super().__init__(args)
        self.current: dict[str, dict] = {}  # this configuration's records so far

    def banner(self) -> str:
        a, m = self.args, self.meta
        return (f"KDA benchmark on {m['device']}: torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; "
                f"sets={a.sets} modes(train)={a.modes} dtype={a.dtype} gate={a.gate_dtype} impls={a.impl_list} "
                f"cudagraphs={a.cudagraphs} timing={a.timing} check={a.check}")

    def groups(self):
        a = self.args
        out = []
        if a.smoke:
            return [(("smoke", m), [Config("smoke", 1, 5, 2, 12, 20, m)]) for m in a.modes]
        if "blog" in a.sets:
            out.append((("blog", "fwd"), [Config("blog", 1, 8, 2, kd, vd) for kd, vd in BLOG_KV]))
        if "long" in a.sets:
            out.append((("long", "fwd"), [Config("long", 1, t, 2, 256, 8192) for t in LONG_T]))
        if "train" in a.sets:
            for m in a.modes:
                out.append((("train", m), [Config("train", 1, a.train_t, 16, d, d, m) for d in a.train_dims]))
        return out

    def implementations(self, group) -> dict[str, common.Impl]:
        a = self.args
        impls = {}
        for name in a.impl_list:
            impls[name] = common.Impl(lambda run, name=name: self.build(name, run),
                                      report=name == "fuser", timing=a.timing)
        if a.cudagraphs and group[0] in ("blog", "smoke"):
            for name in CUDAGRAPH_IMPLS:
                base = name.split("[")[0]
                if base in a.impl_list:
                    impls[name] = common.Impl(lambda run, name=name: self.build(name, run), report=name == "fuser[cg]")
        return impls

    # -- the timed regions ---------------------------------------------------------------
    def build(self, name: str, run: common.ConfigRun):
        cfg, a = run.cfg, self.args
        if name in ("fuser", "fuser[cg]") and cfg.t > a.fuser_loop_max_t:
            return (f"T > --fuser-loop-max-t {a.fuser_loop_max_t}: Dynamo unrolls the loop: capture alone takes "
                    "~22 ms a token (fuser_op measures fuser's kernels here)")
        if name in ("inductor", "inductor[cg]") and cfg.t > a.inductor_max_t:
            return f"T > --inductor-max-t {a.inductor_max_t}: Inductor's compile of the unrolled loop takes minutes"
        if name.endswith("[cg]") and self.device != "cuda":
            return "CUDA graphs need a GPU"
        if name == "eager":
            return self.loop_region(kda_loop, run)
        if name in ("inductor", "fuser", "inductor[cg]", "fuser[cg]"):
            return self.compiled(name, run)
        if name == "fuser_op":
            return self.op_region(run)
        if name in ("fuser[recurrent]", "fuser[parallel]") or name in CHUNK_ROWS:
            return self.kernel_region(name, run)
        if name in FLA_ROWS:
            return self.fla_region(name, run)
        raise ValueError(f"unknown implementation {name}")

    def step(self, name: str) -> Optional[Callable[[], Any]]:
        import torch

        return torch.compiler.cudagraph_mark_step_begin if name.endswith("[cg]") else None

    def compiled(self, name: str, run: common.ConfigRun):
        import torch

        a = self.args
        tag = run.cfg.label.replace(" ", "_").replace("=", "")
        fn = common.fresh_function(kda_loop, f"kda_{name.replace('[', '_').rstrip(']')}_{tag}")
        kw: dict[str, Any] = {"dynamic": False}
        if name.endswith("[cg]"):
            kw["mode"] = "reduce-overhead"
        if name.startswith("fuser"):
            kw["backend"] = "fuser"
            if "mode" not in kw:  # torch.compile refuses mode= with options=
                kw["options"] = dict(a.fuser_options) or None
        return self.loop_region(torch.compile(fn, **kw), run, self.step(name))

    def loop_region(self, fn: Callable, run: common.ConfigRun, step=None):
        """``(o, state)`` (fwd) or ``(o, state, dq, dk, dv, dg, dbeta)`` (fwdbwd) of ``fn(q, k, v,
        g, beta)`` returning ``(o, state)``."""
        import torch

        inp = run.inputs
        if run.cfg.mode == "fwd":
            return common.runner(fn, inp.args, "fwd", step=step)

        def fwdbwd():
            if step is not None:
                step()
            o, s = fn(*inp.args)
            grads = torch.autograd.grad(o, inp.args, inp.do)
            return (o.detach(), s.detach(), *grads)
        return fwdbwd

    def op_region(self, run: common.ConfigRun):
        import torch

        from fuser.patterns import kda_ops  # registers torch.ops.fuser.kda

        cfg, inp = run.cfg, run.inputs
        plan, run.extra["op_plan"], note = planner_choice(inp, cfg, inp.v.dtype)
        mod, why = optional_module(f"fuser.codegen.kda_{kda_ops.parse_plan(plan)['plan']}", "forward")
        if mod is None:
            return UNAVAILABLE + why
        run.extra["op_note"] = note
        scale = cfg.kd ** -0.5

        def kda_op(q, k, v, g, beta):
            # the arguments patterns/kda.py's emit passes for kda_loop
            return torch.ops.fuser.kda(q, k, v, g, beta, None, [1, 1, 1, 1, 1], 0, cfg.t, scale, False, 1, v.dtype,
                                       True, torch.float32, plan)

        return self.loop_region(kda_op, run)

    def flat_inputs(self, run: common.ConfigRun) -> tuple:
        """q, k, v, g, beta, do as ``[B·H, T, *]`` (contiguous copies, made once, untimed)."""
        inp = run.inputs
        if inp.flat is None:
            def flat(x):
                x = x.detach().transpose(1, 2)
                return x.reshape(-1, *x.shape[2:]).contiguous()
            inp.flat = tuple(flat(x) if x is not None else None for x in (*inp.args, inp.do))
        return inp.flat

    def kernel_region(self, name: str, run: common.ConfigRun):
        cfg = run.cfg
        plan = "chunk" if name in CHUNK_ROWS else name[len("fuser["):-1]
        mod, why = optional_module(f"fuser.codegen.kda_{plan}", "forward")
        if mod is None:
            return UNAVAILABLE + why
        if plan == "parallel" and cfg.t > mod.MAX_T:
            return f"the parallel form covers T <= {mod.MAX_T} (one chunk)"
        bwd = None
        if cfg.mode == "fwdbwd":
            bwd, why = optional_module("fuser.codegen.kda_bwd", "backward")
            if bwd is None:
                return UNAVAILABLE + why
        q, k, v, g, beta, do = self.flat_inputs(run)
        scale = cfg.kd ** -0.5
        kw = {"chunk": CHUNK, **CHUNK_ROWS[name]} if plan == "chunk" else {}
        b, h, t = cfg.b, cfg.h, cfg.t

        def unflat(x):  # [B·H, T, F] -> [B, T, H, F] (a view)
            return x.view(b, h, t, x.shape[-1]).transpose(1, 2)

        def state(s):
            return None if s is None else s.view(b, h, cfg.kd, cfg.vd)

        if bwd is None:
            def forced():
                o, s = mod.forward(q, k, v, g, beta, scale=scale, output_final_state=True, out_dtype=v.dtype, **kw)
                return unflat(o), state(s)
            return common.runner(forced, (), "fwd")

        def forced_fwdbwd():
            o, s = mod.forward(q, k, v, g, beta, scale=scale, output_final_state=True, out_dtype=v.dtype, **kw)
            dq, dk, dv, dg, db, _ = bwd.backward(q, k, v, g, beta, do, scale=scale, chunk=CHUNK)
            return (unflat(o), state(s), unflat(dq), unflat(dk), unflat(dv), unflat(dg),
                    db.view(b, h, t).transpose(1, 2))
        return forced_fwdbwd

    def fla_region(self, name: str, run: common.ConfigRun):
        cfg = run.cfg
        if name == "fla_recurrent" and cfg.mode == "fwdbwd":
            return "fused_recurrent_kda is forward only (no backward in FLA 0.6.0)"
        if name == "fla_recurrent" and cfg.kd >= FLA_RECURRENT_HANG_K:
            return f"hangs compiling at K >= {FLA_RECURRENT_HANG_K} (measured)"
        if self.device != "cuda":
            return UNAVAILABLE + "FLA's Triton kernels need a GPU"
        ops, why = fla_ops()
        if ops is None:
            return UNAVAILABLE + why
        fn = ops.fused_recurrent_kda if name == "fla_recurrent" else ops.chunk_kda
        scale = cfg.kd ** -0.5

        def fla(q, k, v, g, beta):
            return fn(q, k, v, g, beta, scale=scale, initial_state=None, output_final_state=True)

        run.extra.setdefault("fla_version", getattr(sys.modules.get("fla"), "__version__", "?"))
        return self.loop_region(fla, run)

    # -- hooks ---------------------------------------------------------------------------
    def inputs(self, cfg: Config) -> Inputs:
        import torch
        import torch.nn.functional as F

        dev, dt = self.device, self.dtype
        gdt = getattr(torch, common.DTYPES[self.args.gate_dtype])
        shape_k, shape_v = (cfg.b, cfg.t, cfg.h, cfg.kd), (cfg.b, cfg.t, cfg.h, cfg.vd)
        q = F.normalize(torch.randn(shape_k, device=dev), dim=-1).to(dt)
        k = F.normalize(torch.randn(shape_k, device=dev), dim=-1).to(dt)
        v = torch.randn(shape_v, device=dev).to(dt)
        g = (-F.softplus(torch.randn(shape_k, device=dev))).to(gdt)
        beta = torch.randn((cfg.b, cfg.t, cfg.h), device=dev).sigmoid().to(dt)
        inp = Inputs(q, k, v, g, beta)
        if cfg.mode == "fwdbwd":
            for x in inp.args:
                x.requires_grad_(True)
            inp.do = torch.randn(shape_v, device=dev).to(dt)
        return inp

    def reference(self, run: common.ConfigRun):
        if self.args.check == "none":
            return None
        budget = 8 * 2**30 if self.device == "cuda" else 2**30
        return reference(run.inputs, run.cfg, self.args.ref_recurrent_max_t, run.cfg.mode == "fwdbwd", budget)

    def check(self, run, out):
        return None if run.ref is None else rel_errs(out, run.ref)

    def new_record(self, impl: str, run) -> dict:
        return {**super().new_record(impl, run), "rel_err_o": None, "rel_err_state": None, "rel_err_grads": None,
                "plan": "", "fused": None}

    def store_check(self, rec: dict, value) -> None:
        e = value or {}
        rec.update(rel_err=e.get("worst"), rel_err_o=e.get("o"), rel_err_state=e.get("state"),
                   rel_err_grads=e.get("grads"))

    def describe(self, report) -> dict:
        return common.fuser_outcome(report, "kda")

    def measure_impl(self, run, name, impl):
        rec = super().measure_impl(run, name, impl)
        if rec is None:
            return rec
        self.current[name] = rec
        if rec["status"] == "skip" and (rec["note"] or "").startswith(UNAVAILABLE):
            rec.update(status="unavailable", note=rec["note"][len(UNAVAILABLE):])
            self.progress(run, name, rec)
        if name == "fuser_op" and run.extra.get("op_note"):
            rec["note"] = run.extra["op_note"] + ("; " + rec["note"] if rec["note"] else "")
            rec["plan"] = run.extra.get("op_plan", "")
        if name in FLA_ROWS and run.extra.get("fla_version"):
            rec["fla"] = run.extra["fla_version"]
        if rec["status"] not in ("skip", "unavailable"):
            self.write_partial(run.cfg)
        return rec

    def write_partial(self, cfg) -> None:
        """The tables with this configuration's measurements so far (a command cut short by its
        time limit during a long compile keeps them)."""
        recs = dict(self.current)
        self.rows.append((cfg, recs, self.summarize(cfg, recs)))
        try:
            self.write(done=False)
        finally:
            self.rows.pop()

    def progress(self, run, name, rec) -> None:
        res = common.fmt_ms(rec["ms"]) + " ms" if rec["status"] == "ok" else rec["status"]
        err = rec.get("rel_err")
        print(f"  {run.cfg.label:<{self.label_width}} {name:<16} {res:>12}  first call {rec['first_call_s'] or 0:7.2f} s"
              + (f"  err {common.fmt_err(err)}" if err is not None else "") + f"  {rec['note'] or ''}", flush=True)

    def run_config(self, cfg, impls):
        import torch

        self.current = {}
        for impl in impls.values():
            impl.info.clear()  # every configuration compiles afresh: no plan carries over
        try:
            return super().run_config(cfg, impls)
        finally:
            torch._dynamo.reset()  # this configuration's compiles (and CUDA-graph pools) go

    # -- derived numbers and tables ------------------------------------------------------
    def is_wrong(self, r: dict, name: str = "") -> bool:
        """An error above ``--dtype``'s tolerance; ``fuser[chunk dots=bf16]`` (bfloat16 dots, an opt-in
        that trades accuracy for speed) is held to bfloat16's whatever the inputs' dtype."""
        tol = max(self.args.tol, WRONG_TOL["bf16"]) if name == "fuser[chunk dots=bf16]" else self.args.tol
        return any(e is not None and not (e <= tol)
                   for e in (r.get("rel_err_o"), r.get("rel_err_state"), r.get("rel_err_grads")))

    def summarize(self, cfg: Config, records: dict[str, dict]) -> dict:
        """Floor, x floor and ratios per impl; the headline fuser row. Only N, H, K, V, mode
        (and dicts) at the top level: the plot's panels are the top-level scalars."""
        import torch

        esize = self.dtype.itemsize
        gsize = getattr(torch, common.DTYPES[self.args.gate_dtype]).itemsize
        nbytes = min_bytes(cfg, esize, gsize)
        floor = common.floor_ms(nbytes, self.args.peak_tbps)
        fla = {nm: common.ok_ms(records, nm) for nm in FLA_ROWS}
        fla = {nm: t for nm, t in fla.items() if t is not None and not self.is_wrong(records[nm])}
        best_fla = min(fla, key=fla.get) if fla else None
        ind = common.ok_ms(records, "inductor")
        for name, r in records.items():
            r["wrong"] = self.is_wrong(r, name)
            ms = r["ms"] if r["status"] == "ok" else None
            r["x_floor"] = common.ratio(ms, floor)
            r["vs_inductor"] = common.ratio(ind, ms)
            r["vs_best_fla"] = common.ratio(fla.get(best_fla), ms)
        head = "fuser" if (records.get("fuser") or {}).get("status") == "ok" else "fuser_op"
        return {"N": cfg.t, "B": cfg.b, "H": cfg.h, "K": cfg.kd, "V": cfg.vd, "mode": cfg.mode,
                "bytes": nbytes, "floor_byte_ms": floor,
                "fuser": {"set": cfg.set, "headline": head if head in records else None, "best_fla": best_fla,
                          "reference": ("recurrent" if cfg.t <= self.args.ref_recurrent_max_t else "chunked")
                          if self.args.check != "none" else "none"}}

    def columns(self) -> list[str]:
        seen = {nm for _, recs, _ in self.rows for nm in recs}
        return [c for c in COLUMN_ORDER if c in seen]

    def main_table(self) -> str:
        cols = self.columns()
        headers = (["set", "T", "H", "K", "V", "mode"] + cols
                   + ["floor ms", "fuser", "fuser x floor", "fuser vs inductor", "fuser vs best FLA",
                      "fuser err o / state / grads"])
        body = []
        for cfg, recs, s in self.rows:
            row = [cfg.set, cfg.t, cfg.h, cfg.kd, cfg.vd, cfg.mode]
            for c in cols:
                r = recs.get(c)
                row.append(common.time_cell(r, wrong=bool(r and r.get("wrong")),
                                            unfused=c in ("fuser", "fuser[cg]") and bool(r) and r.get("fused") is False))
            head = s["fuser"]["headline"]
            h = recs.get(head) if head else None
            row += [common.fmt_ms(s["floor_byte_ms"]), head or "—",
                    common.fmt_sig((h or {}).get("x_floor")) + ("×" if (h or {}).get("x_floor") else ""),
                    common.fmt_ratio((h or {}).get("vs_inductor")),
                    common.fmt_ratio((h or {}).get("vs_best_fla"))
                    + (f" ({s['fuser']['best_fla']})" if (h or {}).get("vs_best_fla") else ""),
                    (("WRONG " if h.get("wrong") else "") + fmt_errs(h)) if h else "—"]
            body.append(row)
        align = "lrrrrl" + "r" * (len(cols) + 1) + "l" + "r" * 3 + "l"
        return common.md_table(headers, body, align)

    def details_table(self) -> str:
        headers = ["set", "T", "H", "K", "V", "mode", "impl", "ms", "x floor", "vs inductor", "vs best FLA",
                   "extra MiB", "first call s", "err o / state / grads", "note"]
        body = []
        for cfg, recs, _ in self.rows:
            for name, r in recs.items():
                body.append([cfg.set, cfg.t, cfg.h, cfg.kd, cfg.vd, cfg.mode, name, common.fmt_ms(r["ms"]),
                             common.fmt_sig(r.get("x_floor")), common.fmt_ratio(r.get("vs_inductor")),
                             common.fmt_ratio(r.get("vs_best_fla")), common.fmt_num(r["extra_mib"], 0),
                             common.first_call_cell(r), ("WRONG " if r.get("wrong") else "") + fmt_errs(r),
                             common.note_cell(r)])
        return common.md_table(headers, body, "lrrrrll" + "r" * 7 + "l")

    def legend(self) -> str:
        a = self.args
        return (
            f"dtype={a.dtype} (q, k, v, beta, o), g in {a.gate_dtype}, state float32; q, k l2-normalised, "
            "g = -softplus(randn), beta = sigmoid(randn), scale = K^-0.5, no initial state, final state returned. "
            + (f"do_bench warmup={a.warmup} ms rep={a.rep} ms (median). " if a.timing == "events" else
               f"do_bench_cudagraph rep={a.rep} ms (median): each call captured in a CUDA graph and replayed, so the "
               "times are GPU time without host overhead ([cg] rows: do_bench; a row whose capture failed says so "
               "in its note). ")
            + "Times in ms. "
            "fuser = torch.compile(loop, backend='fuser'); fuser_op = torch.ops.fuser.kda called directly (the "
            "cost model's plan); fuser[recurrent] / fuser[chunk] / fuser[parallel] = the kernel modules on [B·H, T, *] inputs "
            "(fuser[chunk o=tf32|tf32x3]: its output-path dots forced; fuser[chunk dots=bf16]: bfloat16 dots) "
            "(fwdbwd: + codegen/kda_bwd.backward); [cg] = mode='reduce-overhead' (CUDA graphs). "
            f"Floor = least bytes / {a.peak_tbps:g} TB/s (inputs read once, o and the final state written; "
            "fwdbwd adds the inputs and do read again and the five gradients written). x floor = time / floor; "
            "vs inductor, vs best FLA = their time / this time (> 1: this one is faster). "
            "err = ‖x − ref‖ / ‖ref‖ of o / final state / worst gradient against float64 "
            f"(kda_reference.recurrent up to T={a.ref_recurrent_max_t}, kda_reference.chunked above); above "
            f"{a.tol:g} reads WRONG. † the loop was not fused. Column meanings: docstring of benchmarks/kda.py.")

    def notes(self) -> list[str]:
        notes = super().notes()
        if self.args.check != "none" and "ref_s" in self.state:
            notes.append(f"- float64 references: {self.state['ref_s']:.0f} s in all (untimed)")
        vers = sorted({r.get("fla") for _, recs, _ in self.rows for r in recs.values() if r.get("fla")})
        if vers:
            notes.append(f"- FLA (flash-linear-attention) version: {', '.join(vers)}")
        return notes

    def wrong(self) -> list[str]:
        return [f"{nm} at {cfg.label}" for cfg, recs, _ in self.rows for nm, r in recs.items()
                if nm in FUSER_ROWS and r.get("wrong")]

    def final_lines(self) -> list[str]:
        lines = super().final_lines()
        unfused = [cfg.label for cfg, recs, _ in self.rows
                   if (recs.get("fuser") or {}).get("status") == "ok" and recs["fuser"].get("fused") is False]
        if unfused:
            lines.append("NOTE: fuser did NOT fuse the KDA loop on: " + "; ".join(unfused))
        other = [f"{nm} at {cfg.label}" for cfg, recs, _ in self.rows for nm, r in recs.items()
                 if nm not in FUSER_ROWS and r.get("wrong")]
        if other:
            lines.append(f"NOTE: above {self.args.tol:g} (not fuser): " + "; ".join(other))
        wrong = self.wrong()
        if wrong:
            lines.append(f"!!! WRONG (err > {self.args.tol:g} vs float64) on: " + "; ".join(wrong))
        return lines


def fmt_errs(r: dict) -> str:
    """``o / state / grads`` relative errors (the ones the impl has)."""
    parts = [common.fmt_err(r.get("rel_err_o")), common.fmt_err(r.get("rel_err_state"))]
    if r.get("rel_err_grads") is not None:
        parts.append(common.fmt_err(r["rel_err_grads"]))
    return " / ".join(parts)


def main(argv: Optional[list[str]] = None) -> int:
    return KDABenchmark(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
