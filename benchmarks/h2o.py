"""H2O benchmark: heavy-hitter scores (attention column sums) with the attention output, fuser's
plans against eager PyTorch, Inductor and SDPA.

Usage (on a GPU; one process measures everything side by side)::

    python benchmarks/h2o.py --gqa --out-dir "$OUT"      # default grid + one GQA configuration
    python benchmarks/h2o.py --n 4096 --causal 1         # one shape
    python benchmarks/h2o.py --smoke                     # tiny sizes; runs on CPU (interpreter)

What is measured (H2O, Zhang et al., NeurIPS 2023: keys of a KV cache scored for eviction by the
probability mass the queries give them), on q ``[B, H, N, D]``, k, v ``[B, H_kv, N, D]``,
scale = D^-0.5::

    P = softmax(scale · Q Kᵀ (+ causal -inf above the diagonal)); O = P V; score = P.sum(-2)

in the plain PyTorch spelling, with an fp32 softmax (what H2O's patched attention does)::

    s = q @ k.transpose(-2, -1) * scale
    if causal: s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s.float(), dim=-1)
    return p.to(q.dtype) @ v, p.sum(-2)          # O [B, H, N, D] in q's dtype, score [B, H, N] fp32

(GQA: k and v are repeated to H heads first, transformers' ``repeat_kv``: expand + reshape.)

Implementations (``--impls``; default all):

- ``eager``: that function. ``inductor``: ``torch.compile`` of it (the default: static at the
  first N, dynamic from the second). Both are skipped above ``--baseline-max-n`` (default 8192:
  at N=16384, H=32 the fp32 P alone is 32 GiB).
- ``fuser``: ``torch.compile(..., backend="fuser", dynamic=False)`` of it: compiled per N, so
  the planner chooses at every shape. The plan it chose (``fuser.report.collecting()`` around
  the compiling call, as ``fuser.explain`` shows it) is the ``fuser plan`` column.
- the plans, forced by calling the kernels directly:
  ``fuser.codegen.h2o.forward(q, k, v, scale=..., causal="top_left"|"none", plan=P,
  diagonals=K, cache=L)`` for every P in ``h2o.PLANS`` (``two_kernel``: the attention forward
  then a column-parallel pass recomputing P from the LSE; ``one_kernel``; ``diag_cache``: swept
  over the number of cached diagonals K = 0, 1, 2, 4, ... up to ``h2o.diagonal_count(q, k,
  causal)`` (or ``--diagonals``) and each layout of ``h2o.CACHE_LAYOUTS``; ``causal`` only in
  causal configurations). Plans and arguments that an older ``codegen/h2o.py`` does not have
  are left out. The forced plans are timed as CUDA graph replays (``--plan-timing cudagraph``,
  the default: GPU time alone). Called from Python, each call would pay the direct path's host
  work (argument checks, config lookup, Triton's launcher: ~0.1 ms) that the compiled ``fuser``
  row does not pay (Inductor's wrapper launches its kernels), and at N ≤ 2048 that host time,
  not the plan, would decide which plan looks fastest.
- ``sdpa``: ``F.scaled_dot_product_attention`` (flash on an H100; ``enable_gqa`` for GQA): O
  only, no score; the floor of what attention alone costs.

FlashTensor (PPoPP'25) is not installable here; its published H100 number is quoted in the
notes as a reference (not a measured row).

Measurement per (configuration, impl), by the driver in ``common.py``: synchronize; a first
call (host clock, compilation included: ``first call s``), checked; one call to probe memory
(``extra MiB``: peak allocated during it minus what was allocated before: outputs and
temporaries, not inputs); then ``triton.testing.do_bench(fn, warmup, rep, return_mode="median")``.
``workspace MiB``: ``h2o.workspace_bytes(...)`` of the forced plans, where ``codegen/h2o.py``
has it. Any exception is recorded (``OOM``, ``err: ...``) and the run goes on; the tables are
rewritten after every configuration, and ``--budget-s`` (default 330) stops starting new
measurements so a device call always ends with its tables.

Correctness: O and score of every impl against a reference computed untimed from the same
inputs, head by head: in float64 up to ``--ref-f64-max-n`` (default 4096), above that fp32
eager on the device (TF32 off); ``--check none`` skips it. ``err O / score`` = ‖x − ref‖ /
‖ref‖. fuser and the plans above 2e-2 (fp16/bf16; 1e-3 fp32) read ``WRONG``.

Floor: the least HBM traffic (q, k, v read once, O written in q's dtype, score written in fp32)
at the peak bandwidth, and the FLOPs of the two-kernel plan (two Q Kᵀ and one P V: 6·D per
visible (query, key) pair; N² pairs, N(N+1)/2 causal) at the peak dense fp16 rate; the floor is
the larger. The peaks are an H100 SXM's datasheet numbers (``common.H100_PEAK_TBPS``,
``common.H100_PEAK_TFLOPS_FP16``; ``--peak-tbps``, ``--peak-tflops``). ``%floor`` = floor / time.

Planner's regret: the time of the plan fuser's planner chose (its forced-kernel row, or the
compiled row when that plan was not forced) / the best time among the plans it chooses from
(the forced fuser plans and Inductor) at that shape; 1.00× = it chose the fastest. The forced
rows are GPU time (CUDA graph replays, no L2 flush between calls), the other rows
``do_bench``'s (launched from Python, L2 flushed): the ``timing`` column of the details table
says which; a forced row whose capture failed is timed with events and says why.

Columns of the main table (printed last; ``benchmarks/results/h2o.md``): ``N, mask, H/H_kv``;
``eager``, ``inductor``, ``fuser`` (median ms; ``OOM``, ``err``, ``skip``: see the details table;
``†``: the region was not fused; ``WRONG``); ``fuser plan``; one column per forced plan
(``diag_cache``: its best K and layout); ``sdpa (O only)``; ``floor ms (flop/byte)``; ``fuser
%floor``; ``best plan``; ``regret``; ``fuser extra MiB``; ``fuser err O / score``. The details
table has one row per (configuration, impl). The plot (``h2o.png``): time against K per
configuration, one line per cache layout, two_kernel and one_kernel as horizontal lines (time
against N per impl while no ``diag_cache`` plan exists).

Flags: ``--n``/``--seqs`` (default 1024 2048 4096 8192 16384), ``--causal {0,1,both}``,
``--gqa`` (adds N=``--gqa-n`` (4096), causal, H_kv=``--kv-heads`` (8)), ``--dtype
{fp16,bf16,fp32}`` (fp16), ``--batch``/``--heads``/``--dim`` (1, 32, 128), ``--impls``,
``--diagonals K [K ...]``, ``--layouts``, ``--baseline-max-n``, ``--ref-f64-max-n``, ``--check
{auto,none}``, ``--warmup``/``--rep`` (do_bench ms, 10/50), ``--budget-s``, ``--out``, ``--out-dir``
(or env ``FUSER_BENCH_OUT_DIR``), ``--fuser-option key=value``, ``--peak-tflops``, ``--peak-tbps``,
``--device``, ``--seed``, ``--smoke`` (B=1, H=2 (H_kv=1 with --gqa), D=16, N=64 128, fp32;
results to ``h2o_smoke.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import sys
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

IMPLS = ("eager", "inductor", "fuser", "plans", "sdpa")
BASELINES = ("eager", "inductor", "sdpa")
WRONG_TOL = {"fp16": 2e-2, "bf16": 2e-2, "fp32": 1e-3}
#: FlashTensor (Nie et al., PPoPP'25), H2O on an H100, as published (not measured here).
FLASHTENSOR_MS = {"N": 4096, "causal": True, "dtype": "fp16", "B": 1, "H": 32, "D": 128, "ms": 1.30}


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", "--seqs", dest="seqs", type=int, nargs="+", default=None,
                   help="sequence lengths (default 1024 2048 4096 8192 16384)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--gqa", action="store_true", help="add one GQA configuration (N=--gqa-n, causal, H_kv=--kv-heads)")
    p.add_argument("--gqa-n", type=int, default=None, help="N of the GQA configuration (default 4096)")
    p.add_argument("--kv-heads", type=int, default=None, help="H_kv of the GQA configuration (default 8)")
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help="default fp16 (fp32 with --smoke)")
    p.add_argument("--batch", type=int, default=None, help="default 1")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 32)")
    p.add_argument("--dim", type=int, default=None, help="head dim (default 128)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="plans = every forced plan of h2o.PLANS (default: all)")
    p.add_argument("--plan-timing", choices=common.TIMINGS, default="cudagraph",
                   help="how the forced plans are timed (default cudagraph: GPU time without the direct path's host work)")
    p.add_argument("--diagonals", type=int, nargs="+", default=None,
                   help="diag_cache: the K to measure (default 0 1 2 4 ... up to h2o.diagonal_count)")
    p.add_argument("--layouts", nargs="+", default=None, help="diag_cache layouts (default h2o.CACHE_LAYOUTS)")
    p.add_argument("--baseline-max-n", type=int, default=8192,
                   help="skip eager and Inductor above this N (default %(default)s; 0: no limit)")
    p.add_argument("--ref-f64-max-n", type=int, default=4096,
                   help="float64 reference up to this N, fp32 eager on the device above (default %(default)s)")
    p.add_argument("--check", choices=("auto", "none"), default="auto", help="none: no reference, no errors")
    p.add_argument("--peak-tflops", type=float, default=common.H100_PEAK_TFLOPS_FP16,
                   help="dense fp16 TFLOP/s for the floor (default: H100 SXM, %(default)g)")
    p.add_argument("--peak-tbps", type=float, default=common.H100_PEAK_TBPS,
                   help="HBM TB/s for the floor (default: H100 SXM, %(default)g)")
    common.add_driver_args(p, budget_s=330.0, warmup=10, rep=50, out_name="h2o")
    a = p.parse_args(argv)
    small = a.smoke
    common.finish_driver_args(a, out_name="h2o", warmup=10, rep=50)
    a.seqs = a.seqs or ([64, 128] if small else [1024, 2048, 4096, 8192, 16384])
    a.dtype = a.dtype or ("fp32" if small else "fp16")
    a.batch = a.batch or 1
    a.heads = a.heads or (2 if small else 32)
    a.dim = a.dim or (16 if small else 128)
    a.gqa_n = a.gqa_n or (128 if small else 4096)
    a.kv_heads = a.kv_heads or (1 if small else 8)
    a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    a.tol = WRONG_TOL[a.dtype]
    return a


# --------------------------------------------------------------------------------------------
# the kernels' interface (codegen/h2o.py), as far as it exists
# --------------------------------------------------------------------------------------------

def kernels():
    from fuser.codegen import h2o

    return h2o


def plans() -> tuple[str, ...]:
    """The plans ``codegen/h2o.py`` offers (``("two_kernel",)`` before ``PLANS`` existed)."""
    return tuple(getattr(kernels(), "PLANS", ("two_kernel",)))


def cache_layouts(causal: bool, wanted: Optional[list[str]]) -> list[str]:
    """The diag_cache layouts to measure: ``h2o.CACHE_LAYOUTS`` (or ``--layouts``); ``causal``
    only in causal configurations."""
    layouts = list(wanted or getattr(kernels(), "CACHE_LAYOUTS", ("balanced",)))
    return [lay for lay in layouts if causal or lay != "causal"]


def accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def plan_kwargs(plan: str, diagonals: Optional[int] = None, cache: Optional[str] = None) -> dict:
    """``plan=``, ``diagonals=``, ``cache=`` for ``h2o.forward``: only those it accepts (none
    while ``two_kernel`` is its only plan)."""
    fwd = kernels().forward
    kw: dict[str, Any] = {}
    if hasattr(kernels(), "PLANS") and accepts(fwd, "plan"):
        kw["plan"] = plan
    if diagonals is not None and accepts(fwd, "diagonals"):
        kw["diagonals"] = diagonals
    if cache is not None and accepts(fwd, "cache"):
        kw["cache"] = cache
    return kw


def call_with(fn: Callable, **available) -> Any:
    """``fn`` called with those of ``available`` that it names as parameters."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in available.items() if k in params})


def diagonal_sweep(count: int, wanted: Optional[list[int]]) -> list[int]:
    """K = 0, 1, 2, 4, ... up to ``count`` (and ``count`` itself), or ``--diagonals`` up to it."""
    if wanted:
        return sorted({k for k in wanted if 0 <= k <= count})
    ks = {0, count}
    k = 1
    while k < count:
        ks.add(k)
        k *= 2
    return sorted(ks)


def diag_name(diagonals: int, cache: str) -> str:
    return f"diag_cache K={diagonals} {cache}"


# --------------------------------------------------------------------------------------------
# the spellings
# --------------------------------------------------------------------------------------------

def h2o_function(scale: float, causal: bool) -> Callable:
    """The plain PyTorch spelling that eager, Inductor and fuser all run."""
    import torch

    def repeat_kv(x, groups: int):
        b, h, n, d = x.shape
        return x[:, :, None, :, :].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)

    def h2o_full(q, k, v):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        s = q @ k.transpose(-2, -1) * scale
        p = torch.softmax(s.float(), dim=-1)
        return p.to(q.dtype) @ v, p.sum(-2)

    def h2o_causal(q, k, v):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        s = q @ k.transpose(-2, -1) * scale
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        p = torch.softmax(s.float(), dim=-1)
        return p.to(q.dtype) @ v, p.sum(-2)

    return h2o_causal if causal else h2o_full


def reference(q, k, v, scale: float, causal: bool, dtype, chunk_elems: int = 2**28) -> tuple:
    """``(O, score)`` in ``dtype`` (float64, or float32 with TF32 off), a few query heads at a
    time (at most ``chunk_elems`` scores per chunk), so that no [H, N, N] matrix is ever whole."""
    import torch

    b, hq, n, _ = q.shape
    groups = hq // k.shape[1]
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=dtype, device=q.device)
    score = torch.empty((b, hq, n), dtype=dtype, device=q.device)
    step = max(1, chunk_elems // max(1, b * n * n))
    hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if causal else None
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            for h0 in range(0, hq, step):
                h1 = min(hq, h0 + step)
                kv = torch.arange(h0, h1, device=q.device) // groups
                s = q[:, h0:h1].to(dtype) @ k[:, kv].to(dtype).transpose(-2, -1) * scale
                if hidden is not None:
                    s.masked_fill_(hidden, float("-inf"))
                p = torch.softmax(s, dim=-1)
                out[:, h0:h1] = p @ v[:, kv].to(dtype)
                score[:, h0:h1] = p.sum(-2)
                del s, p
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out, score


# --------------------------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    n: int
    causal: bool
    heads: int
    kv_heads: int

    @property
    def label(self) -> str:
        gqa = f" H/H_kv={self.heads}/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"N={self.n} {common.mask_label(self.causal)}{gqa}"

    @property
    def mode(self) -> str:
        return "top_left" if self.causal else "none"


def flops(cfg: Config, b: int, d: int) -> float:
    """The two-kernel plan's FLOPs: two Q Kᵀ (forward, column pass) and one P V, 6·D per pair."""
    return b * cfg.heads * common.visible_pairs(cfg.n, cfg.causal) * 6.0 * d


def min_bytes(cfg: Config, b: int, d: int, elt: int) -> float:
    """q, k, v read once, O written (q's dtype), score written (fp32)."""
    return float(elt * b * cfg.n * d * (2 * cfg.heads + 2 * cfg.kv_heads) + 4 * b * cfg.heads * cfg.n)


def reference_kind(args, cfg: Config, device: str) -> str:
    if args.check == "none":
        return "none"
    return "float64" if (device == "cpu" or cfg.n <= args.ref_f64_max_n) else "fp32 eager"


class H2OBenchmark(common.Benchmark):
    """H2O: groups (causal, H_kv) over N; every forced plan, fuser's planner, the baselines."""

    title = "fuser H2O benchmark"
    name = "H2O"
    label_width = 30

    def banner(self) -> str:
        a, m = self.args, self.meta
        return (f"H2O benchmark on {m['device']}: torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; "
                f"B={a.batch} H={a.heads} D={a.dim} dtype={a.dtype} N={a.seqs} causal={a.causals} "
                f"gqa={'N=%d H_kv=%d' % (a.gqa_n, a.kv_heads) if a.gqa else 'no'} impls={a.impls} "
                f"plans={plans()} check={a.check}")

    def groups(self):
        a = self.args
        groups = [((causal, a.heads), [Config(n, causal, a.heads, a.heads) for n in a.seqs]) for causal in a.causals]
        if a.gqa:
            causal = True in a.causals
            groups.append(((causal, a.kv_heads), [Config(a.gqa_n, causal, a.heads, a.kv_heads)]))
        return groups

    def implementations(self, group) -> dict[str, common.Impl]:
        """Forced plans first (diag_cache's sweep is added per configuration), then fuser's
        planner, SDPA, Inductor and eager (last: it runs out of memory first)."""
        import torch

        a = self.args
        causal, kv_heads = group
        scale = 1.0 / math.sqrt(a.dim)
        tag = f"{'causal' if causal else 'full'}_hkv{kv_heads}"
        fn = h2o_function(scale, causal)
        impls: dict[str, common.Impl] = {}
        if "plans" in a.impls:
            for plan in plans():
                if plan != "diag_cache":
                    impls[plan] = common.Impl(lambda run, plan=plan: self.forced(run, plan), info={"plan": plan},
                                              timing=a.plan_timing)
        if "fuser" in a.impls:
            f = torch.compile(common.fresh_function(fn, f"h2o_fuser_{tag}"), backend="fuser", dynamic=False,
                              options=dict(a.fuser_options) or None)
            impls["fuser"] = common.Impl(lambda run, f=f: self.timed(f, run), report=True)
        if "sdpa" in a.impls:
            impls["sdpa"] = common.Impl(lambda run: self.timed(self.sdpa(scale, causal, kv_heads != a.heads), run))
        for impl in ("inductor", "eager"):
            if impl in a.impls:
                f = fn if impl == "eager" else torch.compile(common.fresh_function(fn, f"h2o_inductor_{tag}"))
                impls[impl] = common.Impl(lambda run, f=f: self.baseline(f, run))
        return impls

    def implementations_at(self, run, impls):
        """diag_cache: one implementation per (K, layout), after the other forced plans."""
        if "diag_cache" not in plans() or "plans" not in self.args.impls or run.inputs is None:
            return impls
        names = list(impls)
        at = max((i + 1 for i, nm in enumerate(names) if nm in plans()), default=0)
        return {**{nm: impls[nm] for nm in names[:at]}, **self.diag_sweep(run),
                **{nm: impls[nm] for nm in names[at:]}}

    def diag_sweep(self, run: common.ConfigRun) -> dict[str, common.Impl]:
        """``diag_cache K=<K> <layout>`` for every K of the sweep and every layout; one failing
        ``diag_cache`` row when ``h2o.diagonal_count`` fails."""
        q, k, _ = run.inputs
        try:
            count = kernels().diagonal_count(q, k, run.cfg.mode)
        except Exception as exc:  # noqa: BLE001 - one failed row instead of a failed run
            def failed(run, exc=exc):
                raise exc
            return {"diag_cache": common.Impl(failed, info={"plan": "diag_cache"})}
        return {diag_name(d, lay): common.Impl(lambda run, d=d, lay=lay: self.forced(run, "diag_cache", d, lay),
                                               info={"plan": "diag_cache", "diagonals": d, "cache": lay},
                                               timing=self.args.plan_timing)
                for lay in cache_layouts(run.cfg.causal, self.args.layouts)
                for d in diagonal_sweep(count, self.args.diagonals)}

    def timed(self, fn: Callable, run: common.ConfigRun) -> Callable[[], tuple]:
        return common.runner(fn, run.inputs, "fwd")

    def baseline(self, fn: Callable, run: common.ConfigRun):
        limit = self.args.baseline_max_n
        if limit and run.cfg.n > limit:
            return f"N > --baseline-max-n {limit}"
        return self.timed(fn, run)

    def sdpa(self, scale: float, causal: bool, gqa: bool) -> Callable:
        import torch.nn.functional as F

        kw = {"enable_gqa": True} if gqa else {}

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **kw)

        return sdpa

    def forced(self, run: common.ConfigRun, plan: str, diagonals: Optional[int] = None,
               cache: Optional[str] = None):
        """``h2o.forward`` with ``plan`` (and K, layout) forced; notes its workspace."""
        h2o = kernels()
        q, k, v = run.inputs
        kw = {"scale": 1.0 / math.sqrt(self.args.dim), "causal": run.cfg.mode, **plan_kwargs(plan, diagonals, cache)}
        if plan != "two_kernel" and "plan" not in kw:
            return "h2o.forward takes no plan= argument"
        if hasattr(h2o, "workspace_bytes"):
            try:
                ws = call_with(h2o.workspace_bytes, q=q, k=k, v=v, causal=run.cfg.mode, plan=plan,
                               diagonals=diagonals, cache=cache)
                run.extra.setdefault("workspace_mib", {})[plan_label(plan, diagonals, cache)] = ws / 2**20
            except Exception as exc:  # noqa: BLE001 - a column left empty, not a failed row
                run.extra.setdefault("workspace_mib", {})[plan_label(plan, diagonals, cache)] = None
                print(f"  h2o.workspace_bytes failed: {common.short_error(exc)}", file=sys.stderr)

        def h2o_forced():
            return h2o.forward(q, k, v, **kw)

        return common.runner(h2o_forced, (), "fwd")

    def inputs(self, cfg: Config):
        import torch

        a = self.args
        q = torch.randn(a.batch, cfg.heads, cfg.n, a.dim, dtype=self.dtype, device=self.device)
        k, v = (torch.randn(a.batch, cfg.kv_heads, cfg.n, a.dim, dtype=self.dtype, device=self.device)
                for _ in range(2))
        return q, k, v

    def reference(self, run: common.ConfigRun):
        import torch

        kind = reference_kind(self.args, run.cfg, self.device)
        if kind == "none":
            return None
        q, k, v = run.inputs
        dtype = torch.float64 if kind == "float64" else torch.float32
        return reference(q, k, v, 1.0 / math.sqrt(self.args.dim), run.cfg.causal, dtype)

    def check(self, run, out):
        if run.ref is None:
            return None
        return {"out": common.rel_err(out[:1], run.ref[:1]),
                "score": common.rel_err(out[1:2], run.ref[1:2]) if len(out) > 1 else None}

    def new_record(self, impl: str, run) -> dict:
        return {**super().new_record(impl, run), "rel_err_out": None, "rel_err_score": None,
                "workspace_mib": None, "plan": "", "fused": None}

    def store_check(self, rec: dict, value) -> None:
        errs = value or {}
        known = [e for e in (errs.get("out"), errs.get("score")) if e is not None]
        worst = float("nan") if any(math.isnan(e) for e in known) else max(known, default=None)
        rec.update(rel_err=worst, rel_err_out=errs.get("out"), rel_err_score=errs.get("score"))

    def measure_impl(self, run, name, impl):
        rec = super().measure_impl(run, name, impl)
        if rec is not None and rec.get("plan") and name != "fuser":
            rec["workspace_mib"] = run.extra.get("workspace_mib", {}).get(
                plan_label(rec["plan"], rec.get("diagonals"), rec.get("cache")))
        return rec

    def describe(self, report) -> dict:
        return common.fuser_outcome(report, "h2o")

    # -- derived numbers and tables ------------------------------------------------------
    def is_wrong(self, name: str, r: dict) -> bool:
        """fuser or a forced plan above tolerance (or NaN) on O or the score."""
        if name in BASELINES:
            return False
        return any(e is not None and not (e <= self.args.tol) for e in (r.get("rel_err_out"), r.get("rel_err_score")))

    def summarize(self, cfg: Config, records: dict[str, dict]) -> dict:
        """Floors, %floor per impl, the planner's choice and its regret."""
        a = self.args
        fl = flops(cfg, a.batch, a.dim)
        by = min_bytes(cfg, a.batch, a.dim, self.dtype.itemsize)
        floor_flop = common.floor_ms(fl, a.peak_tflops)
        floor_byte = common.floor_ms(by, a.peak_tbps)
        floor = max(floor_flop, floor_byte)
        for name, r in records.items():
            r["pct_floor"] = 100.0 * floor / r["ms"] if r.get("ms") else None
            r["wrong"] = self.is_wrong(name, r)
        candidates = {nm: common.ok_ms(records, nm) for nm, r in records.items()
                      if (r.get("plan") and nm != "fuser") or nm == "inductor"}
        candidates = {nm: t for nm, t in candidates.items() if t is not None}
        best = min(candidates, key=candidates.get) if candidates else None
        fz = records.get("fuser") or {}
        chosen = chosen_impl(fz.get("plan") or "", records)
        chosen_ms = common.ok_ms(records, chosen) if chosen else None
        chosen_from = "forced" if chosen_ms is not None else "compiled"
        if chosen_ms is None:
            chosen_ms = common.ok_ms(records, "fuser")
        diag = {nm: t for nm, t in candidates.items() if records[nm].get("plan") == "diag_cache"}
        planner = {"plan": fz.get("plan") or "", "fused": fz.get("fused"), "chosen": chosen,
                   "chosen_ms": chosen_ms, "chosen_from": chosen_from, "best": best,
                   "best_ms": candidates.get(best), "regret": common.ratio(chosen_ms, candidates.get(best)),
                   "diag_best": min(diag, key=diag.get) if diag else None,
                   "reference": reference_kind(a, cfg, self.device)}
        return {"N": cfg.n, "causal": cfg.causal, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                "flops": fl, "bytes": by, "floor_flop_ms": floor_flop, "floor_byte_ms": floor_byte,
                "planner": planner}

    def plan_columns(self) -> list[str]:
        return [p for p in plans() if p != "diag_cache"] + (["diag_cache best"] if "diag_cache" in plans() else [])

    def main_table(self) -> str:
        a = self.args
        show = {i: i in a.impls for i in IMPLS}
        headers = (["N", "mask", "H/H_kv"] + [i for i in ("eager", "inductor", "fuser") if show[i]]
                   + (["fuser plan"] if show["fuser"] else []) + (self.plan_columns() if show["plans"] else [])
                   + (["sdpa (O only)"] if show["sdpa"] else [])
                   + ["floor ms (flop/byte)", "fuser %floor", "best plan", "regret", "fuser extra MiB",
                      "fuser err O / score"])
        body = []
        for cfg, recs, s in self.rows:
            pl = s["planner"]
            fz = recs.get("fuser")
            row = [cfg.n, common.mask_label(cfg.causal), f"{cfg.heads}/{cfg.kv_heads}"]
            for i in ("eager", "inductor", "fuser"):
                if show[i]:
                    r = recs.get(i)
                    row.append(common.time_cell(r, wrong=bool(r and r.get("wrong")),
                                                unfused=i == "fuser" and bool(r) and r.get("fused") is False))
            if show["fuser"]:
                row.append(pl["plan"] or "—")
            if show["plans"]:
                for col in self.plan_columns():
                    if col == "diag_cache best":
                        d = recs.get(pl["diag_best"]) if pl["diag_best"] else None
                        row.append(f"{common.time_cell(d, wrong=d['wrong'])} (K={d['diagonals']} {d['cache']})"
                                   if d else "—")
                    else:
                        r = recs.get(col)
                        row.append(common.time_cell(r, wrong=bool(r and r.get("wrong"))))
            if show["sdpa"]:
                row.append(common.time_cell(recs.get("sdpa")))
            row += [f"{common.fmt_ms(s['floor_flop_ms'])} / {common.fmt_ms(s['floor_byte_ms'])}",
                    fmt_pct((fz or {}).get("pct_floor")),
                    pl["best"] or "—",
                    common.fmt_ratio(pl["regret"]) + (" (compiled)" if pl["regret"] and pl["chosen_from"] == "compiled" else ""),
                    common.fmt_num((fz or {}).get("extra_mib"), 0),
                    fmt_errs(fz) if fz else "—"]
            body.append(row)
        align = "rll" + "r" * (len(headers) - 3)
        align = "".join("l" if h in ("fuser plan", "best plan") else c for h, c in zip(headers, align))
        return common.md_table(headers, body, align)

    def details_table(self) -> str:
        headers = ["N", "mask", "H/H_kv", "impl", "ms", "timing", "%floor", "extra MiB", "workspace MiB",
                   "first call s", "err O / score", "note"]
        body = []
        for cfg, recs, _ in self.rows:
            for name, r in recs.items():
                body.append([cfg.n, common.mask_label(cfg.causal), f"{cfg.heads}/{cfg.kv_heads}", name, common.fmt_ms(r["ms"]),
                             r.get("timing") or "—", fmt_pct(r.get("pct_floor")), common.fmt_num(r["extra_mib"], 0),
                             common.fmt_sig(r.get("workspace_mib")), common.first_call_cell(r),
                             ("WRONG " if r.get("wrong") else "") + fmt_errs(r), common.note_cell(r)])
        return common.md_table(headers, body, "rlllrl" + "r" * 5 + "l")

    def legend(self) -> str:
        a = self.args
        return (
            f"B={a.batch}, H={a.heads}, D={a.dim}, dtype={a.dtype}, do_bench warmup={a.warmup} ms rep={a.rep} ms "
            "(median). Times in ms. plans = h2o.PLANS forced through fuser.codegen.h2o.forward: "
            f"{', '.join(plans())}, timed by {a.plan_timing} (cudagraph: GPU time, no host launch cost; "
            f"the other rows: do_bench, launched from Python). Floor = max(FLOPs / {a.peak_tflops:g} TFLOP/s, bytes / {a.peak_tbps:g} TB/s) "
            "(H100 SXM datasheet peaks: dense fp16 tensor cores, HBM3); FLOPs = the two-kernel plan's "
            "(2 Q Kᵀ + P V, 6·D per visible pair), bytes = q, k, v read + O, score written. "
            "regret = time of the planner's choice (forced row) / best of the forced plans and Inductor. "
            "err = ‖x − ref‖ / ‖ref‖ of O / score; fuser and the plans above "
            f"{a.tol:g} read WRONG. † the region was not fused. sdpa computes O only. "
            "Column meanings: docstring of benchmarks/h2o.py.")

    def notes(self) -> list[str]:
        a = self.args
        notes = super().notes()
        kinds = sorted({s["planner"]["reference"] for _, _, s in self.rows})
        if a.check != "none":
            notes.append(f"- reference: float64 up to N={a.ref_f64_max_n}, fp32 eager on the device above "
                         f"(head by head; used here: {', '.join(kinds) or '—'}); "
                         f"{self.state.get('ref_s', 0.0):.0f} s in all (untimed)")
        if a.baseline_max_n and any(cfg.n > a.baseline_max_n for cfg, _, _ in self.rows):
            notes.append(f"- eager and Inductor skipped above N={a.baseline_max_n} (--baseline-max-n)")
        ft = FLASHTENSOR_MS
        notes.append(f"- reference, not measured here: FlashTensor (PPoPP'25) reports {ft['ms']:.2f} ms for H2O at "
                     f"N={ft['N']} causal, {ft['dtype']}, B={ft['B']}, H={ft['H']}, D={ft['D']} on an H100")
        return notes

    def to_json(self, done: bool) -> dict:
        data = super().to_json(done)
        data["plans"] = list(plans())
        data["flashtensor_published"] = FLASHTENSOR_MS
        data["plot"] = {"kind": "sweep", "plan": "diag_cache", "x": "diagonals", "series": "cache",
                        "references": [p for p in plans() if p != "diag_cache"], "xlabel": "K (cached diagonals)"}
        return data

    def wrong(self) -> list[str]:
        return [f"{nm} at {cfg.label}" for cfg, recs, _ in self.rows for nm, r in recs.items() if r.get("wrong")]

    def final_lines(self) -> list[str]:
        lines = super().final_lines()
        unfused = [cfg.label for cfg, recs, _ in self.rows
                   if (recs.get("fuser") or {}).get("status") == "ok" and recs["fuser"].get("fused") is False]
        if unfused:
            lines.append("NOTE: fuser did NOT fuse H2O on: " + "; ".join(unfused))
        wrong = self.wrong()
        if wrong:
            lines.append(f"!!! WRONG (err > {self.args.tol:g} vs the reference) on: " + "; ".join(wrong))
        return lines


def plan_label(plan: str, diagonals: Optional[int], cache: Optional[str]) -> str:
    return diag_name(diagonals, cache) if plan == "diag_cache" else plan


def chosen_impl(plan: str, records: dict) -> Optional[str]:
    """The measured implementation that runs what the planner chose (its plan name, e.g.
    ``fuser[two_kernel]``, ``inductor``), or None if none does."""
    if not plan or plan in ("-", "?"):
        return None
    if plan.startswith("inductor"):
        return "inductor"
    for p in sorted(plans(), key=len, reverse=True):
        if p not in plan:
            continue
        if p != "diag_cache":
            return p
        k = re.search(r"(?:diagonals|K)\s*=\s*(\d+)", plan)
        lay = next((lay for lay in ("balanced", "causal", *getattr(kernels(), "CACHE_LAYOUTS", ()))
                    if lay in plan.split(p, 1)[1]), None)
        name = diag_name(int(k.group(1)), lay) if k and lay else None
        return name if name in records else None
    return "two_kernel" if plan == "fuser" and "two_kernel" in records else None


def fmt_pct(x: Optional[float]) -> str:
    return "—" if x is None else common.fmt_sig(x) + "%"


def fmt_errs(r: dict) -> str:
    """``O / score`` relative errors (``O`` alone where there is no score)."""
    cell = common.fmt_err(r.get("rel_err_out"))
    if r.get("rel_err_score") is not None:
        cell += " / " + common.fmt_err(r["rel_err_score"])
    return cell


def main(argv: Optional[list[str]] = None) -> int:
    return H2OBenchmark(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
