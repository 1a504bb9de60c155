"""Attention-KL benchmark: fuser vs eager PyTorch and Inductor on KL(teacher ‖ student attention).

KL(P1 ‖ P2) between a teacher's and a student's attention distributions over the same keys.

Usage (on a GPU; one process measures everything side by side)::

    python benchmarks/attention_kl.py --long --out-dir "$OUT"   # default grid + N=131072 (fuser): fits one 10-min call
    python benchmarks/attention_kl.py --out-dir "$OUT"          # default grid only (H100: ~3-4 min)
    python benchmarks/attention_kl.py --seqs 8192 16384 --modes fwdbwd --grads student both
    python benchmarks/attention_kl.py --smoke                   # tiny sizes; runs on CPU (interpreter)

What is measured: the loss users write for attention distillation, on [B, H, N, D] tensors
(side 1 = teacher q1, k1; side 2 = student q2, k2; same keys, same mask), scale = D^-0.5::

    def kl_loss(q1, k1, q2, k2):
        s1 = q1 @ k1.transpose(-2, -1) * scale; s2 = q2 @ k2.transpose(-2, -1) * scale
        if causal:
            m = torch.ones(N, N, dtype=torch.bool, device=q1.device).triu(1)
            s1 = s1.masked_fill(m, torch.finfo(s1.dtype).min); s2 = s2.masked_fill(m, torch.finfo(s2.dtype).min)
        kl = F.kl_div(F.log_softmax(s2.float(), -1), F.log_softmax(s1.float(), -1),
                      reduction="none", log_target=True)
        if causal: kl = kl.masked_fill(m, 0.0)
        return kl.sum(-1).mean()

(N is read from ``s1.shape[-1]`` inside the function, so one compiled function serves every N.)

Implementations (``--impls``; default all three):

- ``eager``: that function, plain PyTorch.
- ``inductor``: ``torch.compile`` of it (default backend).
- ``fuser``: ``torch.compile(..., backend="fuser")`` of it. The plan fuser chose (from
  ``fuser.report.collecting()`` around the compiling call: ``rep.fused`` entries with
  ``.pattern == "attention_kl"`` and ``.plan.name``, e.g. ``fuser[split_k=1, backward=two_kernel]``)
  is shown in the ``fuser plan`` column. ``†`` on fuser's time: the KL was NOT fused (no match, a
  near-miss, or the planner left it to Inductor); the details table says why. To force fuser's
  kernels or one backward variant: ``--fuser-option fuser.plan=attention_kl.impl=fuser`` /
  ``--fuser-option fuser.plan=attention_kl.backward=two_kernel``.

Modes (``--modes``): ``fwd`` = the loss under ``torch.no_grad()`` (no input requires grad);
``fwdbwd`` = the loss plus ``torch.autograd.grad(loss, inputs that require grad)``, timed
together. Grads (``--grads``, one or both, each a separate fwdbwd row): ``student`` = only q2, k2
require grad (frozen teacher, the usual distillation setup; BENCHMARKS.md's targets are for
this); ``both`` = q1, k1, q2, k2 all require grad.

Sequence lengths: ``--seqs`` (default 2048 4096 8192 16384 32768) for every impl; ``--long``
adds ``--long-seqs`` (default 131072) for fuser alone (eager and Inductor would need ~1 TB).

Compilation: one compiled function per (impl, mode, grads, causal), reused across N, each a
separate code object (``common.fresh_function``) so Dynamo caches never collide. ``--shapes
dynamic`` (default) marks N dynamic from the first call (one compile per variant: fuser's plan
is chosen at the first N and kept); ``auto`` leaves it to Dynamo; ``static`` compiles every N
(each N gets its own plan, and its first call includes compilation).

Measurement per (configuration, impl), via ``common.measure``: synchronize; a first call, timed
with a host clock (includes compilation: ``first call s``); one untimed call to probe memory;
then ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")``. Extra MiB = peak memory
allocated during one call minus what was allocated before it (inputs excluded; the loss, the
gradients and every temporary included). ``fuser ws MiB`` = that minus the gradients' own bytes
(the workspace: statistics, fp32 dQ accumulators, masks, ...). Any exception is recorded
(``OOM`` or ``err: ...``) and the run goes on; eager and Inductor are expected to OOM from
N=16384 / 32768 on 80 GB. Inputs: fresh seeded ``torch.randn`` per configuration (teacher and
student independent). Results are rewritten after every configuration, so a run cut short still
leaves its tables; ``--budget-s`` (default 520) stops starting new measurements after that many
seconds so that a 10-minute device call always writes them.

Correctness: every impl's loss (and, in fwdbwd, its gradients) against a float32 reference,
computed untimed from the same (bf16) inputs upcast to fp32: the same math (``finfo.min``
masking, ``kl_div(log_target=True)``) in chunks of query rows, keys beyond the causal diagonal
skipped, so it fits in memory at every N (N=131072 fwdbwd: ~20-30 s on an H100).
``rel err`` = |loss − ref| / |ref| and the worst ‖grad − ref‖ / ‖ref‖ over the gradients. fuser
above 1e-2 on the loss or 2e-2 on the gradients (bf16/fp16; 1e-3 both for fp32) reads ``WRONG``,
in the time cell too. (For scale: eager bf16's own gradients are ~7e-3 off fp32, its loss ~1e-4.)
``--check loss`` skips the reference gradients; ``--check none`` skips the reference.

FLOP and exp counts (the floor): per visible (query, key) pair the forward does two score dot
products, 2·2·D FLOPs (4·D), and two exponentials (P1, P2). Pairs = N² or N(N+1)/2 causal.
Forward FLOPs = 4·B·H·pairs·D, exps = 2·B·H·pairs. Backward (nothing N² is stored, so both
score matrices are recomputed: 4·D FLOPs and 2 exps per pair) plus the gradient products,
2·D each: dQ2 = dS2·K2 and dK2 = dS2ᵀ·Q2 for a frozen teacher (``student``: 8·D per pair = 2×
forward), and also dQ1, dK1 with ``both`` (12·D per pair = 3× forward); so backward ≈ 2.5×
forward on average; fwdbwd = 3× (student) or 4× (both) forward FLOPs and 4 exps per pair.
Floors: FLOPs / ``--peak-tflops`` (790 TFLOP/s bf16 dense, measured on the H100) and exps /
``--peak-exps`` (MUFU ex2: 132 SMs × 16/clk × 1.755 GHz ≈ 3.7e12/s). Both are printed;
``%floor`` = the larger floor / fuser's time.

Targets (shared/BENCHMARKS.md, grads=student): N=8192, both masks: fwd ≥ 5× and fwd+bwd ≥ 4×
faster than Inductor; N=16384: fuser's extra memory ≤ 64 MiB (fwd: all of it; fwdbwd: the
workspace, gradients excluded); N=131072: runs. ``✓`` or ``✗`` with what was missed; ``—``
where no target applies or the comparison is missing (e.g. Inductor not run).

Columns of the main table (printed last, and written to ``benchmarks/results/attention_kl.md``):
``N, mask, mode, grads``; ``eager``, ``inductor``, ``fuser`` (median ms; ``OOM``, ``err``, ``skip``:
see the details table; ``†``/``WRONG`` as above); ``fuser plan``; ``floor ms (flop/exp)``;
``fuser TFLOP/s``; ``fuser %floor``; ``vs Inductor``, ``vs eager`` (other time / fuser time: > 1 =
fuser faster); ``extra MiB ind/fuser``; ``fuser ws MiB``; ``fuser rel err``; ``target``. The details
table has one row per (configuration, impl): ms, TFLOP/s, extra MiB, first call s (``+k`` =
graphs Dynamo compiled during it), rel err vs the fp32 reference, note (fuser's plan, errors).

Flags: ``--seqs``, ``--long``, ``--long-seqs``, ``--causal {0,1,both}``, ``--modes
{fwd,fwdbwd,both}``, ``--grads {student,both} [...]``, ``--impls``, ``--dtype {bf16,fp16,fp32}``,
``--batch``/``--heads``/``--dim`` (1, 16, 128), ``--warmup``/``--rep`` (do_bench ms, 25/100),
``--shapes``, ``--check {all,loss,none}``, ``--budget-s`` (0 = no limit), ``--out`` (markdown path;
JSON beside it), ``--out-dir`` (or env ``FUSER_BENCH_OUT_DIR``: also copy both files there, e.g.
``$OUT``), ``--fuser-option key=value`` (repeatable), ``--compile-mode`` (``torch.compile``'s
``mode`` for Inductor and fuser alike, e.g. ``reduce-overhead``: CUDA graphs, with
``torch.compiler.cudagraph_mark_step_begin()`` before every timed call; fuser then gets no
``--fuser-option``, as torch.compile refuses mode with options), ``--peak-tflops``, ``--peak-exps``,
``--device``, ``--seed``, ``--smoke`` (B=1, H=2, D=16, N=64 128, fp32; ``--long`` adds N=256;
results to ``attention_kl_smoke.md``).

Time on an H100 (estimate from before the first run; the full grid plus ``--long`` took ~5 min): process start and imports ~10 s; compiles ~1-2 min
(Inductor ~15-30 s per variant, fuser a few s, 4 variants each); eager and Inductor at
N ≤ 8192/16384 take ≤ 75 ms per call and ~10 calls per measurement; the OOMs are quick; the fp32
reference ~10 s in all. Default grid (20 configurations): ~3-4 min. ``--long`` adds four fuser
configurations at N=131072 (fuser ~0.3 s fwd / ~1 s fwdbwd per call, the reference ~5-30 s
each): ~1.5 min. ``--grads student both`` adds 10 fwdbwd configurations: ~1.5 min. The command
for one 10-minute device call: ``python benchmarks/attention_kl.py --long --out-dir "$OUT"``
(the 520 s budget guard writes the tables whatever happens).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMPLS = ("eager", "inductor", "fuser")
RUN_ORDER = ("fuser", "inductor", "eager")  # the subject first; eager last (it OOMs soonest)
SUBJECT = "fuser"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
WRONG_TOL = {"bf16": (1e-2, 2e-2), "fp16": (1e-2, 2e-2), "fp32": (1e-3, 1e-3)}  # (loss, gradients)
TARGET_N_SPEED = 8192
TARGET_SPEED = {"fwd": 5.0, "fwdbwd": 4.0}  # fuser vs Inductor, from shared/BENCHMARKS.md
TARGET_N_MEMORY = 16384
TARGET_MEMORY_MIB = 64.0
TARGET_N_RUNS = 131072
PEAK_EXPS_T = 132 * 16 * 1.755e9 / 1e12  # ≈ 3.7 T exps/s: MUFU ex2 on an H100 SXM


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help="sequence lengths for every impl (default 2048 4096 8192 16384 32768)")
    p.add_argument("--long", action="store_true", help="also run --long-seqs, fuser only")
    p.add_argument("--long-seqs", type=int, nargs="+", default=None,
                   help="sequence lengths for fuser alone with --long (default 131072; 256 with --smoke)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--modes", choices=("fwd", "fwdbwd", "both"), default="both")
    p.add_argument("--grads", nargs="+", choices=("student", "both"), default=["student"],
                   help="which side requires grad in fwdbwd: student (q2, k2) and/or both (q1, k1, q2, k2)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--batch", type=int, default=None, help="default 1")
    p.add_argument("--heads", type=int, default=None, help="default 16")
    p.add_argument("--dim", type=int, default=None, help="head dim, both sides (default 128)")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warm-up ms (default 25)")
    p.add_argument("--rep", type=int, default=None, help="do_bench repetition ms (default 100)")
    p.add_argument("--shapes", choices=("dynamic", "auto", "static"), default="dynamic")
    p.add_argument("--check", choices=("all", "loss", "none"), default="all",
                   help="fp32 reference for the loss and gradients (all), the loss only, or none")
    p.add_argument("--budget-s", type=float, default=520.0,
                   help="start no new measurement after this many seconds (0: no limit)")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown path (default benchmarks/results/attention_kl.md; attention_kl_smoke.md with --smoke)")
    p.add_argument("--out-dir", default=os.environ.get("FUSER_BENCH_OUT_DIR", ""),
                   help="also copy the .md and .json here (env FUSER_BENCH_OUT_DIR)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode for inductor and fuser (e.g. reduce-overhead: CUDA graphs)")
    p.add_argument("--fuser-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option for torch.compile(backend='fuser', options=...), repeatable")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--peak-exps", type=float, default=PEAK_EXPS_T, help="T exps/s (default %(default).2f)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (B=1, H=2, D=16, N=64 128, fp32): an end-to-end check, also on CPU")
    a = p.parse_args(argv)
    small = a.smoke
    a.seqs = a.seqs or ([64, 128] if small else [2048, 4096, 8192, 16384, 32768])
    a.long_seqs = a.long_seqs or ([256] if small else [TARGET_N_RUNS])
    a.dtype = a.dtype or ("fp32" if small else "bf16")
    a.batch = a.batch or 1
    a.heads = a.heads or (2 if small else 16)
    a.dim = a.dim or (16 if small else 128)
    a.warmup = a.warmup if a.warmup is not None else (1 if small else 25)
    a.rep = a.rep if a.rep is not None else (5 if small else 100)
    a.out = a.out or common.RESULTS_DIR / ("attention_kl_smoke.md" if small else "attention_kl.md")
    a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    a.mode_list = ["fwd", "fwdbwd"] if a.modes == "both" else [a.modes]
    a.grads = list(dict.fromkeys(a.grads))
    a.impl_list = [i for i in RUN_ORDER if i in a.impls]
    a.fuser_options = dict(common.parse_option(s) for s in a.fuser_option)
    a.tol_loss, a.tol_grads = WRONG_TOL[a.dtype]
    return a


# --------------------------------------------------------------------------------------------
# the implementations
# --------------------------------------------------------------------------------------------

def kl_loss_function(scale: float, causal: bool) -> Callable:
    """The plain PyTorch spelling that eager, Inductor and fuser all run."""
    import torch
    import torch.nn.functional as F

    def attention_kl_full(q1, k1, q2, k2):
        s1 = q1 @ k1.transpose(-2, -1) * scale
        s2 = q2 @ k2.transpose(-2, -1) * scale
        kl = F.kl_div(F.log_softmax(s2.float(), -1), F.log_softmax(s1.float(), -1),
                      reduction="none", log_target=True)
        return kl.sum(-1).mean()

    def attention_kl_causal(q1, k1, q2, k2):
        s1 = q1 @ k1.transpose(-2, -1) * scale
        s2 = q2 @ k2.transpose(-2, -1) * scale
        n = s1.shape[-1]
        m = torch.ones(n, n, dtype=torch.bool, device=q1.device).triu(1)
        s1 = s1.masked_fill(m, torch.finfo(s1.dtype).min)
        s2 = s2.masked_fill(m, torch.finfo(s2.dtype).min)
        kl = F.kl_div(F.log_softmax(s2.float(), -1), F.log_softmax(s1.float(), -1),
                      reduction="none", log_target=True)
        kl = kl.masked_fill(m, 0.0)
        return kl.sum(-1).mean()

    return attention_kl_causal if causal else attention_kl_full


@dataclasses.dataclass
class Variant:
    """One implementation for one (mode, grads, causal): a callable ``fn(q1, k1, q2, k2)``
    reused across N, plus what is known about how it compiled (fuser's plan)."""

    impl: str
    fn: Callable
    note: str = ""
    plan: str = ""
    fused: Optional[bool] = None


def build_variants(args, mode: str, grads: str, causal: bool) -> dict[str, Variant]:
    import torch

    scale = 1.0 / math.sqrt(args.dim)
    tag = f"{mode}_{grads}_{'causal' if causal else 'full'}"
    dynamic = False if args.shapes == "static" else None
    eager = kl_loss_function(scale, causal)
    variants: dict[str, Variant] = {}
    for impl in args.impl_list:
        if impl == "eager":
            variants[impl] = Variant(impl, eager)
            continue
        kw: dict[str, Any] = {"dynamic": dynamic}
        if args.compile_mode:
            kw["mode"] = args.compile_mode
        if impl == "fuser":
            kw["backend"] = "fuser"
            if not args.compile_mode:  # torch.compile refuses mode= with options=
                kw["options"] = dict(args.fuser_options) or None
        variants[impl] = Variant(impl, torch.compile(common.fresh_function(eager, f"kl_{impl}_{tag}"), **kw))
    return variants


def describe_fuser(report) -> tuple[str, str, Optional[bool]]:
    """``(note, plan, fused)`` from a fuser report of the graphs compiled during one call;
    ``("", "", None)`` when nothing was compiled (a cached compile was reused)."""
    if report is None or not getattr(report, "graphs", 0):
        return "", "", None
    try:
        kl = [m for m in report.fused if m.pattern == "attention_kl"]
        others = sorted({m.pattern for m in report.fused if m.pattern != "attention_kl"})
        extra = f"; also fused: {', '.join(others)}" if others else ""
        if kl:
            plans = sorted({m.plan.name if m.plan else "?" for m in kl})
            return "fused: " + ", ".join(plans) + extra, ", ".join(plans), True
        unfused = [m for m in report.matches if m.pattern == "attention_kl"]
        if unfused:
            m = unfused[0]
            plan = m.plan.name if m.plan else "-"
            return f"NOT fused (planner: {plan}: {m.reason}){extra}", plan, False
        rej = [r for r in report.rejected if r.pattern == "attention_kl"]
        if rej:
            return f"NOT fused (rejected: {rej[0].reason}){extra}", "-", False
        return f"NOT fused (no attention_kl match; {report.graphs} graph(s)){extra}", "-", False
    except Exception as exc:  # noqa: BLE001
        return f"(report unreadable: {exc})", "?", None


# --------------------------------------------------------------------------------------------
# one configuration
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    n: int
    causal: bool
    mode: str
    grads: str  # "-" in fwd
    long: bool = False  # fuser alone

    @property
    def label(self) -> str:
        g = f" grads={self.grads}" if self.mode == "fwdbwd" else ""
        return f"N={self.n} {'causal' if self.causal else 'none'} {self.mode}{g}"

    @property
    def wrt(self) -> tuple[int, ...]:
        """Indices into (q1, k1, q2, k2) that require grad."""
        if self.mode == "fwd":
            return ()
        return (0, 1, 2, 3) if self.grads == "both" else (2, 3)


def pairs(cfg: Config) -> float:
    return cfg.n * (cfg.n + 1) / 2 if cfg.causal else float(cfg.n) * cfg.n


def flops(cfg: Config, b: int, h: int, d: int) -> float:
    """4·D per pair forward (two QKᵀ); backward 8·D (student) or 12·D (both): see docstring."""
    per_pair = 4.0 * d
    if cfg.mode == "fwdbwd":
        per_pair += (12.0 if cfg.grads == "both" else 8.0) * d
    return b * h * pairs(cfg) * per_pair


def exps(cfg: Config, b: int, h: int) -> float:
    """Two exps per pair forward (P1, P2), two more in the backward (recomputed)."""
    return b * h * pairs(cfg) * (4.0 if cfg.mode == "fwdbwd" else 2.0)


def make_inputs(args, cfg: Config, dtype, device: str, seed: int) -> list:
    import torch

    torch.manual_seed(seed)
    shape = (args.batch, args.heads, cfg.n, args.dim)
    ts = [torch.randn(shape, dtype=dtype, device=device) for _ in range(4)]
    for i in cfg.wrt:
        ts[i].requires_grad_(True)
    if args.shapes == "dynamic":
        for t in ts:
            torch._dynamo.maybe_mark_dynamic(t, 2)
    return ts


def make_runner(fn: Callable, cfg: Config, inputs: list, graphs: bool = False) -> Callable[[], tuple]:
    """The timed region: the loss (no_grad), or the loss + its gradients. ``graphs``: a new
    CUDA-graph step begins with every call (``--compile-mode reduce-overhead``)."""
    import torch

    step = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)
    if cfg.mode == "fwd":
        def run_fwd():
            step()
            with torch.no_grad():
                return (fn(*inputs),)
        return run_fwd

    wrt = [inputs[i] for i in cfg.wrt]

    def run_fwdbwd():
        step()
        loss = fn(*inputs)
        grads = torch.autograd.grad(loss, wrt)
        return (loss.detach(), *grads)
    return run_fwdbwd


def reference(inputs: list, cfg: Config, scale: float, with_grads: bool,
              chunk_elems: int = 2**28) -> tuple:
    """``(loss, *grads)`` in float32 from the inputs upcast to fp32: the user's math, in chunks of
    query rows (keys past the causal diagonal skipped) so that no N×N matrix is ever whole
    (``chunk_elems`` scores per chunk: 1 GiB per fp32 matrix, ~10 GiB peak with gradients)."""
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference even if TF32 is on
    try:
        return _reference(inputs, cfg, scale, with_grads, chunk_elems)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _reference(inputs: list, cfg: Config, scale: float, with_grads: bool, chunk_elems: int) -> tuple:
    import torch
    import torch.nn.functional as F

    b, h, n, _ = inputs[0].shape
    wrt = cfg.wrt if with_grads else ()
    full = [t.detach().float() for t in inputs]
    grads = {i: torch.zeros_like(full[i]) for i in wrt}
    rows = max(1, min(n, chunk_elems // max(1, b * h * n)))
    neg = torch.finfo(torch.float32).min
    total = torch.zeros((), dtype=torch.float64, device=full[0].device)
    denom = float(b * h * n)
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        kend = i1 if cfg.causal else n
        # this chunk's operands as leaves: q rows i0:i1, k rows :kend
        parts = [full[0][:, :, i0:i1], full[1][:, :, :kend], full[2][:, :, i0:i1], full[3][:, :, :kend]]
        parts = [x.requires_grad_(True) if i in grads else x for i, x in enumerate(t.detach() for t in parts)]
        q1, k1, q2, k2 = parts
        with torch.set_grad_enabled(bool(grads)):
            s1 = q1 @ k1.transpose(-2, -1) * scale
            s2 = q2 @ k2.transpose(-2, -1) * scale
            hidden = None
            if cfg.causal:
                hidden = (torch.arange(i0, i1, device=q1.device)[:, None]
                          < torch.arange(kend, device=q1.device)[None, :])
                s1 = s1.masked_fill(hidden, neg)
                s2 = s2.masked_fill(hidden, neg)
            kl = F.kl_div(F.log_softmax(s2, -1), F.log_softmax(s1, -1), reduction="none", log_target=True)
            if hidden is not None:
                kl = kl.masked_fill(hidden, 0.0)
            part = kl.sum() / denom
        if grads:
            idx = sorted(grads)
            got = torch.autograd.grad(part, [parts[i] for i in idx])
            for i, g in zip(idx, got):
                if i in (0, 2):
                    grads[i][:, :, i0:i1] = g
                else:
                    grads[i][:, :, :kend] += g
        total += part.detach().double()
        del s1, s2, kl, part, hidden, parts
    return (total.float(), *(grads[i] for i in wrt))


def rel_errs(got: tuple, ref: tuple) -> dict:
    """``{"loss": e, "grads": e or None, "worst": e}``: ‖a − b‖ / ‖b‖ in fp32; NaN if not finite."""
    import torch

    def one(a, b):
        num = torch.linalg.vector_norm(a.detach().float() - b.float()).item()
        den = torch.linalg.vector_norm(b.float()).item()
        e = num / max(den, 1e-30)
        return e if math.isfinite(e) else float("nan")

    loss = one(got[0], ref[0])
    g = [one(a, b) for a, b in zip(got[1:], ref[1:])]
    grads = (float("nan") if any(math.isnan(x) for x in g) else max(g)) if g else None
    parts = [loss] + ([grads] if grads is not None else [])
    worst = float("nan") if any(math.isnan(x) for x in parts) else max(parts)
    return {"loss": loss, "grads": grads, "worst": worst}


def run_config(args, cfg: Config, variants: dict[str, Variant], dtype, device: str, seed: int,
               state: dict) -> dict[str, dict]:
    """Measure every impl on one configuration; returns impl -> result record."""
    records: dict[str, dict] = {}
    impls = [i for i in variants if not cfg.long or i == SUBJECT]
    budget_left = not (args.budget_s and common.elapsed_s() > args.budget_s)
    if not impls or state.get("broken") or not budget_left:
        why = "CUDA context broken by an earlier error" if state.get("broken") else \
            f"time budget ({args.budget_s:.0f} s) spent"
        if not budget_left:
            state["budget_hit"] = True
        for impl in impls:
            records[impl] = _record(impl, status="skip", note=why)
        return records

    inputs = make_inputs(args, cfg, dtype, device, seed)
    grad_bytes = sum(inputs[i].numel() * inputs[i].element_size() for i in cfg.wrt)
    ref: Optional[tuple] = None
    ref_note = ""
    if args.check != "none":
        try:
            common.synchronize(device)
            t0 = common.elapsed_s()
            ref = reference(inputs, cfg, 1.0 / math.sqrt(args.dim), with_grads=args.check == "all")
            common.synchronize(device)
            state.setdefault("ref_s", 0.0)
            state["ref_s"] += common.elapsed_s() - t0
        except Exception as exc:  # noqa: BLE001
            ref_note = f"fp32 reference failed: {common.short_error(exc)}"
            state.setdefault("ref_errors", []).append(f"{cfg.label}: {common.describe_error(exc)}")
            ref = None
            common.free_memory(device, collect=True)

    for impl in impls:
        var = variants[impl]
        rec = _record(impl, note=var.note)
        rec["grad_mib"] = grad_bytes / 2**20
        records[impl] = rec
        if state.get("broken"):
            rec.update(status="skip", note="CUDA context broken by an earlier error")
            continue
        if args.budget_s and common.elapsed_s() > args.budget_s:
            rec.update(status="skip", note=f"time budget ({args.budget_s:.0f} s) spent")
            state["budget_hit"] = True
            continue

        def check(out):
            return None if ref is None else rel_errs(out, ref)

        collector = common.fuser_collector() if impl == SUBJECT else None
        m = common.measure(make_runner(var.fn, cfg, inputs, bool(args.compile_mode)), device, args.warmup, args.rep,
                           check=check, on_first=collector)
        if impl == SUBJECT:
            note, plan, fused = describe_fuser(m.first_context)
            if note:  # compiled during this call; else the variant's earlier compile stands
                var.note, var.plan, var.fused = note, plan, fused
        errs = m.check or {}
        rec.update(status=m.status, ms=m.ms, extra_mib=m.extra_mib, first_call_s=m.first_call_s,
                   graphs_compiled=m.graphs_compiled, rel_err=errs.get("worst"),
                   rel_err_loss=errs.get("loss"), rel_err_grads=errs.get("grads"), error=m.error,
                   note=var.note if impl == SUBJECT else rec["note"], plan=var.plan, fused=var.fused)
        if ref_note:
            rec["note"] = (rec["note"] + "; " if rec["note"] else "") + ref_note
        if m.error and common.context_broken(m.error):
            state["broken"] = True
        print(f"  {cfg.label:<36} {impl:<9} {m.status if not m.ok else common.fmt_ms(m.ms) + ' ms':>12}"
              f"  first call {m.first_call_s or 0:7.2f} s  err {common.fmt_err(errs.get('worst'))}"
              f"  {rec['note'] or ''}", flush=True)
    inputs = ref = None  # noqa: F841 - release before the next configuration
    common.free_memory(device)
    return records


def _record(impl: str, **kw) -> dict:
    rec = {"impl": impl, "status": "ok", "ms": None, "extra_mib": None, "first_call_s": None,
           "graphs_compiled": None, "rel_err": None, "rel_err_loss": None, "rel_err_grads": None,
           "note": "", "plan": "", "fused": None, "error": None, "grad_mib": 0.0}
    rec.update(kw)
    return rec


# --------------------------------------------------------------------------------------------
# derived numbers and tables
# --------------------------------------------------------------------------------------------

def summarize(args, cfg: Config, records: dict[str, dict]) -> dict:
    """Config-level numbers: FLOPs, exps, floors, TFLOP/s per impl, fuser's ratios, workspace,
    error and target."""
    fl = flops(cfg, args.batch, args.heads, args.dim)
    ex = exps(cfg, args.batch, args.heads)
    floor_flop = fl / (args.peak_tflops * 1e12) * 1e3
    floor_exp = ex / (args.peak_exps * 1e12) * 1e3
    for r in records.values():
        r["tflops"] = fl / (r["ms"] * 1e-3) / 1e12 if r.get("ms") else None

    def ms(impl):
        r = records.get(impl)
        return r["ms"] if r and r["status"] == "ok" else None

    s = {"N": cfg.n, "causal": cfg.causal, "mode": cfg.mode, "grads": cfg.grads, "long": cfg.long,
         "flops": fl, "exps": ex, "floor_flop_ms": floor_flop, "floor_exp_ms": floor_exp, "fuser": None}
    r = records.get(SUBJECT)
    if r is not None:
        f = ms(SUBJECT)
        ws = r["extra_mib"] - r["grad_mib"] if r.get("extra_mib") is not None else None
        d = {"ms": f, "status": r["status"],
             "pct_floor": 100.0 * max(floor_flop, floor_exp) / f if f else None,
             "vs_inductor": ms("inductor") / f if (f and ms("inductor")) else None,
             "vs_eager": ms("eager") / f if (f and ms("eager")) else None,
             "extra_mib": r.get("extra_mib"), "workspace_mib": ws,
             "rel_err": r.get("rel_err"), "rel_err_loss": r.get("rel_err_loss"),
             "rel_err_grads": r.get("rel_err_grads"), "wrong": is_wrong(args, r),
             "fused": r.get("fused") is not False, "plan": r.get("plan") or ""}
        d["target"] = target_cell(cfg, d)
        s["fuser"] = d
    return s


def is_wrong(args, r: dict) -> bool:
    """Above tolerance (or NaN) on the loss or on the gradients."""
    el, eg = r.get("rel_err_loss"), r.get("rel_err_grads")
    return (el is not None and not (el <= args.tol_loss)) or (eg is not None and not (eg <= args.tol_grads))


def fmt_errs(r: dict) -> str:
    """``loss`` or ``loss / grads`` relative errors."""
    cell = common.fmt_err(r.get("rel_err_loss"))
    if r.get("rel_err_grads") is not None:
        cell += " / " + common.fmt_err(r["rel_err_grads"])
    return cell


def target_cell(cfg: Config, d: dict) -> str:
    if d["wrong"]:
        return "✗ WRONG"
    if d["status"] == "skip":
        return "—"
    applies = cfg.grads in ("-", "student") and cfg.n in (TARGET_N_SPEED, TARGET_N_MEMORY, TARGET_N_RUNS)
    if d["status"] != "ok":
        return "✗ " + d["status"].split(":")[0] if (applies or cfg.long) else "—"
    if not applies:
        return "—"
    missed, checked = [], False
    if cfg.n == TARGET_N_SPEED and d["vs_inductor"] is not None:
        checked = True
        goal = TARGET_SPEED[cfg.mode]
        if d["vs_inductor"] < goal:
            missed.append(f"<{goal:g}× Inductor")
    if cfg.n == TARGET_N_MEMORY and d["workspace_mib"] is not None:
        checked = True
        if d["workspace_mib"] > TARGET_MEMORY_MIB:
            missed.append(f">{TARGET_MEMORY_MIB:g} MiB")
    if cfg.n == TARGET_N_RUNS:
        checked = True
    if not d["fused"]:
        missed.append("not fused")
    if not checked and not missed:
        return "—"
    return "✗ " + ", ".join(missed) if missed else "✓"


def impl_cell(r: Optional[dict], summary: dict, impl: str) -> str:
    if r is None:
        return "—"
    subj = summary["fuser"] if impl == SUBJECT else None
    if r["status"] != "ok":
        cell = r["status"].split(":")[0]
        return cell + " WRONG" if subj and subj["wrong"] else cell
    cell = common.fmt_ms(r["ms"])
    if subj:
        if subj["wrong"]:
            cell += " WRONG"
        if not subj["fused"]:
            cell += " †"
    return cell


def mask_label(cfg: Config) -> str:
    return "causal" if cfg.causal else "none"


def main_table(args, rows: list[tuple[Config, dict, dict]]) -> str:
    impls = [i for i in IMPLS if i in args.impl_list]
    have_ind, have_eager = "inductor" in impls, "eager" in impls
    headers = (["N", "mask", "mode", "grads"] + impls
               + ["fuser plan", "floor ms (flop/exp)", "fuser TFLOP/s", "fuser %floor"]
               + (["vs Inductor"] if have_ind else []) + (["vs eager"] if have_eager else [])
               + ["extra MiB ind/fuser" if have_ind else "fuser extra MiB", "fuser ws MiB",
                  "fuser rel err loss / grads", "target"])
    body = []
    for cfg, recs, s in rows:
        row = ([cfg.n, mask_label(cfg), cfg.mode, cfg.grads]
               + [impl_cell(recs.get(i), s, i) for i in impls]
               + [(s["fuser"] or {}).get("plan") or "—",
                  f"{common.fmt_ms(s['floor_flop_ms'])} / {common.fmt_ms(s['floor_exp_ms'])}"])
        d = s["fuser"]
        ind = recs.get("inductor")
        ind_mib = common.fmt_num(ind["extra_mib"], 0) if ind and ind["status"] == "ok" else \
            (ind["status"].split(":")[0] if ind else "—")
        d = d or {}
        err = fmt_errs(d) if d else "—"
        fuser_mib = common.fmt_num(d.get("extra_mib"), 0)
        row += [common.fmt_sig((recs.get(SUBJECT) or {}).get("tflops")),
                common.fmt_sig(d.get("pct_floor")) + ("%" if d.get("pct_floor") else "")]
        row += [common.fmt_ratio(d.get("vs_inductor"))] if have_ind else []
        row += [common.fmt_ratio(d.get("vs_eager"))] if have_eager else []
        row += [f"{ind_mib} / {fuser_mib}" if have_ind else fuser_mib, common.fmt_sig(d.get("workspace_mib")),
                ("WRONG " + err) if d.get("wrong") else err, d.get("target", "—")]
        body.append(row)
    align = "rlll" + "r" * len(impls) + "l" + "r" * (len(headers) - len(impls) - 6) + "l"
    return common.md_table(headers, body, align)


def details_table(args, rows: list[tuple[Config, dict, dict]]) -> str:
    headers = ["N", "mask", "mode", "grads", "impl", "ms", "TFLOP/s", "extra MiB", "first call s",
               "rel err loss / grads", "note"]
    body = []
    for cfg, recs, _ in rows:
        for impl in IMPLS:
            r = recs.get(impl)
            if r is None:
                continue
            err = fmt_errs(r)
            if impl == SUBJECT and is_wrong(args, r):
                err = "WRONG " + err
            body.append([cfg.n, mask_label(cfg), cfg.mode, cfg.grads, impl, common.fmt_ms(r["ms"]),
                         common.fmt_sig(r.get("tflops")), common.fmt_num(r["extra_mib"], 0),
                         common.first_call_cell(r), err, common.note_cell(r)])
    return common.md_table(headers, body, "rllll" + "r" * 5 + "l")


def errors_section(rows: list[tuple[Config, dict, dict]], state: dict) -> str:
    lines = common.error_lines(rows)
    for e in state.get("ref_errors", []):
        lines.append(f"- fp32 reference at {e[:600]}".replace("\n", " "))
    return "\n".join(lines)


def legend(args) -> str:
    return (
        f"B={args.batch}, H={args.heads}, D={args.dim}, dtype={args.dtype}, shapes={args.shapes}, "
        f"compile mode={args.compile_mode or 'default'}, "
        f"do_bench warmup={args.warmup} ms rep={args.rep} ms (median). Times in ms. "
        "grads: which side requires grad in fwdbwd (student = q2, k2; both = q1, k1, q2, k2). "
        f"Floors: FLOPs / {args.peak_tflops:g} TFLOP/s and exps / {args.peak_exps:.2f}e12/s (MUFU); "
        "FLOPs per visible pair 4·D fwd, +8·D (student) / +12·D (both) bwd; exps 2 fwd, +2 bwd. "
        "Ratios: other time / fuser time (>1: fuser faster). extra MiB: peak during one call minus "
        "before it (inputs excluded); ws = fuser's extra minus its gradients. "
        f"rel err vs an fp32 reference: loss / worst gradient; above {args.tol_loss:g} / {args.tol_grads:g} "
        "reads WRONG. "
        "† the KL was not fused (see details). "
        f"target (grads=student): N={TARGET_N_SPEED} fwd ≥{TARGET_SPEED['fwd']:g}×, fwdbwd "
        f"≥{TARGET_SPEED['fwdbwd']:g}× Inductor; N={TARGET_N_MEMORY} ws ≤{TARGET_MEMORY_MIB:g} MiB; "
        f"N={TARGET_N_RUNS} runs. Column meanings: docstring of benchmarks/attention_kl.py.")


def render(args, meta: dict, rows, state: dict, done: bool) -> tuple[str, str, str]:
    """(full markdown for the file, details+errors for stdout, main table)."""
    notes = []
    if state.get("budget_hit"):
        notes.append(f"- time budget of {args.budget_s:.0f} s was spent; later measurements were skipped")
    if state.get("broken"):
        notes.append("- a CUDA error broke the context; later measurements were skipped")
    if "ref_s" in state:
        notes.append(f"- fp32 reference: {state['ref_s']:.0f} s in all (untimed)")
    return common.report("fuser attention-KL benchmark", meta, done, notes, legend(args), main_table(args, rows),
                         details_table(args, rows), errors_section(rows, state))


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    force_cpu = args.device == "cpu"
    common.setup_environment(force_cpu=force_cpu)
    import torch

    device = "cuda" if (args.device != "cpu" and torch.cuda.is_available()) else "cpu"
    if args.device == "cuda" and device != "cuda":
        print("--device cuda: no CUDA device found", file=sys.stderr)
        return 2
    if SUBJECT in args.impl_list:
        import fuser  # noqa: F401 - registers backend="fuser"
    warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")
    if args.shapes == "static":
        common.raise_recompile_limit(64)
    dtype = getattr(torch, DTYPES[args.dtype])
    meta = common.env_header(device)
    long_seqs = [n for n in args.long_seqs if n not in args.seqs] if args.long and SUBJECT in args.impl_list else []
    print(f"attention-KL benchmark on {meta['device']}: torch {meta['torch']}, triton {meta['triton']}, "
          f"CUDA {meta['cuda']}; B={args.batch} H={args.heads} D={args.dim} dtype={args.dtype} "
          f"seqs={args.seqs} long(fuser only)={long_seqs} causal={args.causals} modes={args.mode_list} "
          f"grads={args.grads} impls={args.impl_list} shapes={args.shapes} check={args.check}", flush=True)
    if device == "cpu":
        print("No GPU: CPU timing with a host clock; fuser's kernels run in Triton's interpreter. "
              "Numbers are for checking the script, not for reading.", flush=True)

    rows: list[tuple[Config, dict, dict]] = []
    state: dict[str, Any] = {}
    seed = args.seed
    groups = [(mode, g) for mode in args.mode_list for g in (["-"] if mode == "fwd" else args.grads)]
    for mode, grads in groups:
        for causal in args.causals:
            variants = build_variants(args, mode, grads, causal)
            for n, is_long in [(n, False) for n in args.seqs] + [(n, True) for n in long_seqs]:
                cfg = Config(n, causal, mode, grads, is_long)
                seed += 1
                recs = run_config(args, cfg, variants, dtype, device, seed, state)
                rows.append((cfg, recs, summarize(args, cfg, recs)))
                md, _, _ = render(args, meta, rows, state, done=False)
                common.write_outputs(args.out, md, common.to_json(args, meta, rows, False), args.out_dir)
            del variants
            common.free_memory(device, collect=True)

    md, stdout, main_tbl = render(args, meta, rows, state, done=True)
    written = common.write_outputs(args.out, md, common.to_json(args, meta, rows, True), args.out_dir)
    wrong = [cfg.label for cfg, _, s in rows if s["fuser"] and s["fuser"]["wrong"]]
    unfused = [cfg.label for cfg, _, s in rows if s["fuser"] and s["fuser"]["status"] == "ok" and not s["fuser"]["fused"]]
    print("\n" + stdout + "\n")
    print("wrote " + ", ".join(str(p) for p in written))
    if state.get("budget_hit"):
        print(f"NOTE: time budget of {args.budget_s:.0f} s was spent; later measurements were skipped.")
    if state.get("broken"):
        print("NOTE: a CUDA error broke the context; later measurements were skipped.")
    if unfused:
        print("NOTE: fuser did NOT fuse the KL on: " + "; ".join(unfused))
    if wrong:
        print(f"!!! fuser WRONG (rel err > {args.tol_loss:g} loss / {args.tol_grads:g} gradients vs fp32) on: "
              + "; ".join(wrong))
    print(f"total {common.elapsed_s():.0f} s\n")
    print(f"## fuser attention-KL benchmark — {meta['device']}, torch {meta['torch']}, "
          f"triton {meta['triton']}, CUDA {meta['cuda']}\n\n{legend(args)}\n")
    print(main_tbl, flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
