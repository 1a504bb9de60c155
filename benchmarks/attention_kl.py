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

Measurement per (configuration, impl), by the driver in ``common.py`` (``common.measure``): synchronize; a first call, timed
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
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMPLS = ("eager", "inductor", "fuser")
RUN_ORDER = ("fuser", "inductor", "eager")  # the subject first; eager last (it OOMs soonest)
SUBJECT = "fuser"
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
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--batch", type=int, default=None, help="default 1")
    p.add_argument("--heads", type=int, default=None, help="default 16")
    p.add_argument("--dim", type=int, default=None, help="head dim, both sides (default 128)")
    p.add_argument("--shapes", choices=("dynamic", "auto", "static"), default="dynamic")
    p.add_argument("--check", choices=("all", "loss", "none"), default="all",
                   help="fp32 reference for the loss and gradients (all), the loss only, or none")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode for inductor and fuser (e.g. reduce-overhead: CUDA graphs)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--peak-exps", type=float, default=PEAK_EXPS_T, help="T exps/s (default %(default).2f)")
    common.add_driver_args(p, budget_s=520.0, out_name="attention_kl")
    a = p.parse_args(argv)
    small = a.smoke
    common.finish_driver_args(a, out_name="attention_kl")
    a.seqs = a.seqs or ([64, 128] if small else [2048, 4096, 8192, 16384, 32768])
    a.long_seqs = a.long_seqs or ([256] if small else [TARGET_N_RUNS])
    a.dtype = a.dtype or ("fp32" if small else "bf16")
    a.batch = a.batch or 1
    a.heads = a.heads or (2 if small else 16)
    a.dim = a.dim or (16 if small else 128)
    a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    a.mode_list = ["fwd", "fwdbwd"] if a.modes == "both" else [a.modes]
    a.grads = list(dict.fromkeys(a.grads))
    a.impl_list = [i for i in RUN_ORDER if i in a.impls]
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


# --------------------------------------------------------------------------------------------
# the grid, the reference
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
    return common.visible_pairs(cfg.n, cfg.causal)


def flops(cfg: Config, b: int, h: int, d: int) -> float:
    """4·D per pair forward (two QKᵀ); backward 8·D (student) or 12·D (both): see docstring."""
    per_pair = 4.0 * d
    if cfg.mode == "fwdbwd":
        per_pair += (12.0 if cfg.grads == "both" else 8.0) * d
    return b * h * pairs(cfg) * per_pair


def exps(cfg: Config, b: int, h: int) -> float:
    """Two exps per pair forward (P1, P2), two more in the backward (recomputed)."""
    return b * h * pairs(cfg) * (4.0 if cfg.mode == "fwdbwd" else 2.0)


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
    loss = common.rel_err(got[:1], ref[:1])
    grads = common.rel_err(got[1:], ref[1:]) if len(ref) > 1 else None
    parts = [loss] + ([grads] if grads is not None else [])
    worst = float("nan") if any(math.isnan(x) for x in parts) else max(parts)
    return {"loss": loss, "grads": grads, "worst": worst}


class AttentionKLBenchmark(common.Benchmark):
    """KL(teacher ‖ student attention): groups (mode, grads, causal) over N (plus the long N,
    fuser alone); the check is against a chunked fp32 reference computed before the impls."""

    title = "fuser attention-KL benchmark"
    name = "attention-KL"
    label_width = 36
    reference_label = "fp32 reference"

    def banner(self) -> str:
        a, m = self.args, self.meta
        return (f"attention-KL benchmark on {m['device']}: torch {m['torch']}, triton {m['triton']}, "
                f"CUDA {m['cuda']}; B={a.batch} H={a.heads} D={a.dim} dtype={a.dtype} "
                f"seqs={a.seqs} long(fuser only)={self.long_seqs()} causal={a.causals} modes={a.mode_list} "
                f"grads={a.grads} impls={a.impl_list} shapes={a.shapes} check={a.check}")

    def long_seqs(self) -> list[int]:
        a = self.args
        return [n for n in a.long_seqs if n not in a.seqs] if a.long and SUBJECT in a.impl_list else []

    def groups(self):
        a = self.args
        groups = [(mode, g) for mode in a.mode_list for g in (["-"] if mode == "fwd" else a.grads)]
        return [((mode, grads, causal),
                 [Config(n, causal, mode, grads, False) for n in a.seqs]
                 + [Config(n, causal, mode, grads, True) for n in self.long_seqs()])
                for mode, grads in groups for causal in a.causals]

    def implementations(self, group) -> dict[str, common.Impl]:
        """One compiled function per impl for this (mode, grads, causal), reused across N."""
        import torch

        a = self.args
        mode, grads, causal = group
        scale = 1.0 / math.sqrt(a.dim)
        tag = f"{mode}_{grads}_{'causal' if causal else 'full'}"
        dynamic = False if a.shapes == "static" else None
        eager = kl_loss_function(scale, causal)
        impls: dict[str, common.Impl] = {}
        for impl in a.impl_list:
            fn = eager
            if impl != "eager":
                kw: dict[str, Any] = {"dynamic": dynamic}
                if a.compile_mode:
                    kw["mode"] = a.compile_mode
                if impl == "fuser":
                    kw["backend"] = "fuser"
                    if not a.compile_mode:  # torch.compile refuses mode= with options=
                        kw["options"] = dict(a.fuser_options) or None
                fn = torch.compile(common.fresh_function(eager, f"kl_{impl}_{tag}"), **kw)
            impls[impl] = common.Impl(lambda run, fn=fn: self.timed(fn, run), report=impl == SUBJECT)
        return impls

    def timed(self, fn: Callable, run: common.ConfigRun) -> Callable[[], tuple]:
        """The loss (no_grad), or the loss and its gradients; with ``--compile-mode``, a new
        CUDA-graph step begins with every call."""
        import torch

        inputs = run.inputs
        step = torch.compiler.cudagraph_mark_step_begin if self.args.compile_mode else None
        return common.runner(fn, inputs, run.cfg.mode, [inputs[i] for i in run.cfg.wrt], step=step)

    def implementations_at(self, run, impls):
        return {k: v for k, v in impls.items() if k == SUBJECT} if run.cfg.long else impls

    def inputs(self, cfg: Config) -> list:
        import torch

        a = self.args
        shape = (a.batch, a.heads, cfg.n, a.dim)
        ts = [torch.randn(shape, dtype=self.dtype, device=self.device) for _ in range(4)]
        for i in cfg.wrt:
            ts[i].requires_grad_(True)
        if a.shapes == "dynamic":
            for t in ts:
                torch._dynamo.maybe_mark_dynamic(t, 2)
        return ts

    def reference(self, run: common.ConfigRun):
        if self.args.check == "none":
            return None
        return reference(run.inputs, run.cfg, 1.0 / math.sqrt(self.args.dim), with_grads=self.args.check == "all")

    def check(self, run, out):
        return None if run.ref is None else rel_errs(out, run.ref)

    def new_record(self, impl: str, run) -> dict:
        grad_bytes = sum(run.inputs[i].numel() * run.inputs[i].element_size() for i in run.cfg.wrt) \
            if run.inputs is not None else 0
        return {**super().new_record(impl, run), "rel_err_loss": None, "rel_err_grads": None,
                "plan": "", "fused": None, "grad_mib": grad_bytes / 2**20}

    def store_check(self, rec: dict, value) -> None:
        errs = value or {}
        rec.update(rel_err=errs.get("worst"), rel_err_loss=errs.get("loss"), rel_err_grads=errs.get("grads"))

    def describe(self, report) -> dict:
        return common.fuser_outcome(report, "attention_kl")

    # -- derived numbers and tables ------------------------------------------------------
    def summarize(self, cfg: Config, records: dict[str, dict]) -> dict:
        """Config-level numbers: FLOPs, exps, floors, TFLOP/s per impl, fuser's ratios, workspace,
        error and target."""
        a = self.args
        fl = flops(cfg, a.batch, a.heads, a.dim)
        ex = exps(cfg, a.batch, a.heads)
        floor_flop = common.floor_ms(fl, a.peak_tflops)
        floor_exp = common.floor_ms(ex, a.peak_exps)
        for r in records.values():
            r["tflops"] = fl / (r["ms"] * 1e-3) / 1e12 if r.get("ms") else None
        s = {"N": cfg.n, "causal": cfg.causal, "mode": cfg.mode, "grads": cfg.grads, "long": cfg.long,
             "flops": fl, "exps": ex, "floor_flop_ms": floor_flop, "floor_exp_ms": floor_exp, "fuser": None}
        r = records.get(SUBJECT)
        if r is not None:
            f = common.ok_ms(records, SUBJECT)
            ws = r["extra_mib"] - r["grad_mib"] if r.get("extra_mib") is not None else None
            d = {"ms": f, "status": r["status"],
                 "pct_floor": 100.0 * max(floor_flop, floor_exp) / f if f else None,
                 "vs_inductor": common.ratio(common.ok_ms(records, "inductor"), f),
                 "vs_eager": common.ratio(common.ok_ms(records, "eager"), f),
                 "extra_mib": r.get("extra_mib"), "workspace_mib": ws,
                 "rel_err": r.get("rel_err"), "rel_err_loss": r.get("rel_err_loss"),
                 "rel_err_grads": r.get("rel_err_grads"), "wrong": is_wrong(a, r),
                 "fused": r.get("fused") is not False, "plan": r.get("plan") or ""}
            d["target"] = target_cell(cfg, d)
            s["fuser"] = d
        return s

    def main_table(self) -> str:
        impls = [i for i in IMPLS if i in self.args.impl_list]
        have_ind, have_eager = "inductor" in impls, "eager" in impls
        headers = (["N", "mask", "mode", "grads"] + impls
                   + ["fuser plan", "floor ms (flop/exp)", "fuser TFLOP/s", "fuser %floor"]
                   + (["vs Inductor"] if have_ind else []) + (["vs eager"] if have_eager else [])
                   + ["extra MiB ind/fuser" if have_ind else "fuser extra MiB", "fuser ws MiB",
                      "fuser rel err loss / grads", "target"])
        body = []
        for cfg, recs, s in self.rows:
            d = s["fuser"] or {}
            row = ([cfg.n, common.mask_label(cfg.causal), cfg.mode, cfg.grads]
                   + [common.time_cell(recs.get(i), wrong=i == SUBJECT and bool(d.get("wrong")),
                                       unfused=i == SUBJECT and bool(d) and not d["fused"]) for i in impls]
                   + [d.get("plan") or "—",
                      f"{common.fmt_ms(s['floor_flop_ms'])} / {common.fmt_ms(s['floor_exp_ms'])}"])
            ind = recs.get("inductor")
            ind_mib = common.fmt_num(ind["extra_mib"], 0) if ind and ind["status"] == "ok" else \
                (ind["status"].split(":")[0] if ind else "—")
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

    def details_table(self) -> str:
        headers = ["N", "mask", "mode", "grads", "impl", "ms", "TFLOP/s", "extra MiB", "first call s",
                   "rel err loss / grads", "note"]
        body = []
        for cfg, recs, _ in self.rows:
            for impl in IMPLS:
                r = recs.get(impl)
                if r is None:
                    continue
                err = fmt_errs(r)
                if impl == SUBJECT and is_wrong(self.args, r):
                    err = "WRONG " + err
                body.append([cfg.n, common.mask_label(cfg.causal), cfg.mode, cfg.grads, impl, common.fmt_ms(r["ms"]),
                             common.fmt_sig(r.get("tflops")), common.fmt_num(r["extra_mib"], 0),
                             common.first_call_cell(r), err, common.note_cell(r)])
        return common.md_table(headers, body, "rllll" + "r" * 5 + "l")

    def legend(self) -> str:
        a = self.args
        return (
            f"B={a.batch}, H={a.heads}, D={a.dim}, dtype={a.dtype}, shapes={a.shapes}, "
            f"compile mode={a.compile_mode or 'default'}, "
            f"do_bench warmup={a.warmup} ms rep={a.rep} ms (median). Times in ms. "
            "grads: which side requires grad in fwdbwd (student = q2, k2; both = q1, k1, q2, k2). "
            f"Floors: FLOPs / {a.peak_tflops:g} TFLOP/s and exps / {a.peak_exps:.2f}e12/s (MUFU); "
            "FLOPs per visible pair 4·D fwd, +8·D (student) / +12·D (both) bwd; exps 2 fwd, +2 bwd. "
            "Ratios: other time / fuser time (>1: fuser faster). extra MiB: peak during one call minus "
            "before it (inputs excluded); ws = fuser's extra minus its gradients. "
            f"rel err vs an fp32 reference: loss / worst gradient; above {a.tol_loss:g} / {a.tol_grads:g} "
            "reads WRONG. "
            "† the KL was not fused (see details). "
            f"target (grads=student): N={TARGET_N_SPEED} fwd ≥{TARGET_SPEED['fwd']:g}×, fwdbwd "
            f"≥{TARGET_SPEED['fwdbwd']:g}× Inductor; N={TARGET_N_MEMORY} ws ≤{TARGET_MEMORY_MIB:g} MiB; "
            f"N={TARGET_N_RUNS} runs. Column meanings: docstring of benchmarks/attention_kl.py.")

    def notes(self) -> list[str]:
        notes = super().notes()
        if "ref_s" in self.state and self.args.check != "none":
            notes.append(f"- fp32 reference: {self.state['ref_s']:.0f} s in all (untimed)")
        return notes

    def wrong(self) -> list[str]:
        return [cfg.label for cfg, _, s in self.rows if s["fuser"] and s["fuser"]["wrong"]]

    def final_lines(self) -> list[str]:
        lines = super().final_lines()
        unfused = [cfg.label for cfg, _, s in self.rows
                   if s["fuser"] and s["fuser"]["status"] == "ok" and not s["fuser"]["fused"]]
        if unfused:
            lines.append("NOTE: fuser did NOT fuse the KL on: " + "; ".join(unfused))
        wrong = self.wrong()
        if wrong:
            lines.append(f"!!! fuser WRONG (rel err > {self.args.tol_loss:g} loss / {self.args.tol_grads:g} "
                         "gradients vs fp32) on: " + "; ".join(wrong))
        return lines


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


def main(argv: Optional[list[str]] = None) -> int:
    return AttentionKLBenchmark(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
