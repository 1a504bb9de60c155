"""Config sweep for the attention-KL and attention Triton kernels: time every candidate launch config.

Usage (on a GPU, one process)::

    python benchmarks/tune_attention_kl.py --out-dir "$OUT"   # N=8192, both causal modes, the attention-KL families
    python benchmarks/tune_attention_kl.py --families fwd bwd_frozen_two --causal 1 --seqs 4096 16384
    python benchmarks/tune_attention_kl.py --list             # the candidates, as on an H100; runs nothing
    python benchmarks/tune_attention_kl.py --smoke --out-dir /tmp/tune_smoke   # tiny sizes, CPU (interpreter)
    python benchmarks/tune_attention_kl.py --families attn_fwd --batch 4 --seqs 1024 2048 --timing cudagraph

What is measured: the launchers of ``codegen/attention_kl.py``, called directly with one explicit
``config=`` each, on seeded ``randn`` q1, k1, q2, k2 ``[B, H, N, D]`` (default B=1, H=16, D=128,
bf16; scale D^-0.5; causal = ``"top_left"``, the same as bottom-right for Nq == Nk). Families:
``fwd`` = ``forward(need_stats=True)`` (training), ``fwd_nostats`` (inference); ``bwd_frozen_atomic``
/ ``bwd_frozen_two`` = ``backward(needs_grad=(F, F, T, T))``, bwd_mode atomic_dq / two_kernel;
``bwd_both_two`` / ``bwd_both_atomic``: all four gradients (the forward runs once per group, table
default, for the statistics; only ``backward`` is timed). Attention (``codegen/attention.py``, q, k, v
``[B, H, N, D]``, no data mask): ``attn_fwd`` = ``forward(need_lse=True)`` (training), ``attn_fwd_nolse``
(inference); each of their groups also times ``torch.nn.functional.scaled_dot_product_attention``
on the same inputs (whichever backend torch picks; the row ``SDPA`` of the summary, ``best vs SDPA`` =
SDPA ms / best ms). Order: family, causal, N, configs.

Candidates: the current table's entries for the key (``candidate_configs``), its default first,
then the grids below, deduplicated (atomic_dq ignores BLOCK_M2/N2). Forward: ``FWD_*`` axes pruned
by :func:`keep_fwd` (36 -> 19). Backward: ``BWD_DK_TILES`` x warps x stages pruned by :func:`keep_bwd`
(30 -> 17), each with the transposed dQ tile (FA2's pairing, as in the tables); two_kernel also
sweeps ``BWD_DQ_TILES`` at the default's dK tile, warps and stages.

Per config (``common.measure``): a first call (host clock, synchronized: ``first call s``), the
check, a memory probe (``extra MiB``), ``do_bench(warmup, rep, return_mode="median")``. A config
that raises (OutOfResources, compile error) reads ``error: ...``. ``--jobs J`` (GPU default
min(12, cores - 4)) compiles ahead in J spawned processes, each config run once in sweep order at
N' = N (N <= 512) else 256 + N % 16 (same Triton specialization), so this process finds Triton's
disk cache warm: ``compile s`` = the worker's first call, ``first call s`` then only loads the
binary. Check: each output (rows, statistics; gradients) vs the default config's, max |diff| /
max |default|, the worst (attention: also SDPA's output vs the default's); above 1e-2 (bf16/fp16; fp32 1e-3) reads WRONG. FLOPs as in
``benchmarks/attention_kl.py`` (useful work, plan-independent): per visible pair 4·D fwd, 8·D bwd
frozen, 12·D bwd both (attention forward: 4·D); pairs N² or N(N+1)/2 causal. ``--timing cudagraph``:
``do_bench_cudagraph`` (GPU time alone, no launch cost; a short kernel's host launch would otherwise
decide its row) instead of ``do_bench``.

Outputs: ``tune_attention_kl.md`` / ``.json`` in ``--out-dir`` (env ``FUSER_BENCH_OUT_DIR``, else
``$TMPDIR/tune_attention_kl``), rewritten after every group (``--out PATH``: there, copied to
``--out-dir``): per (family, causal, N) the configs fastest first (``*``: in the current table), the
fastest five as table literals, and a summary of best vs default (printed last). ``--budget-s``
(540): no new config after that many seconds; the tables are still written.

Time (H100, estimated): 228 configs by default (``--list``), ~2-4 s of compile each (~1-1.5 min over
12 jobs) and ~0.3-0.5 s of measuring each (~2 min, overlapping), ~20 s of start: ~3-5 min. With
``--jobs 0`` it does not fit (540 s reach about the fourth family).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TITLE = "fuser attention-KL / attention config sweep"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
WRONG_TOL = {"bf16": 1e-2, "fp16": 1e-2, "fp32": 1e-3}
DEFAULTS = {"seqs": [8192], "dtype": "bf16", "heads": 16, "dim": 128, "warmup": 10, "rep": 40, "max_configs": 0}
SMOKE = {"seqs": [80], "dtype": "fp32", "heads": 2, "dim": 16, "warmup": 1, "rep": 5, "max_configs": 2}
FROZEN, BOTH = (False, False, True, True), (True, True, True, True)
FAMILIES = {  # name -> launcher arguments
    "fwd": {"kind": "fwd", "need_stats": True},
    "fwd_nostats": {"kind": "fwd", "need_stats": False},
    "bwd_frozen_atomic": {"kind": "bwd", "needs_grad": FROZEN, "bwd_mode": "atomic_dq"},
    "bwd_frozen_two": {"kind": "bwd", "needs_grad": FROZEN, "bwd_mode": "two_kernel"},
    "bwd_both_two": {"kind": "bwd", "needs_grad": BOTH, "bwd_mode": "two_kernel"},
    "bwd_both_atomic": {"kind": "bwd", "needs_grad": BOTH, "bwd_mode": "atomic_dq"},
    "attn_fwd": {"kind": "fwd", "kernel": "attention", "need_lse": True},
    "attn_fwd_nolse": {"kind": "fwd", "kernel": "attention", "need_lse": False},
}
KL_FAMILIES = [f for f, spec in FAMILIES.items() if "kernel" not in spec]


def is_attention(fam: str) -> bool:
    return FAMILIES[fam].get("kernel") == "attention"


# --------------------------------------------------------------------------------------------
# candidate grids (edit here)
# --------------------------------------------------------------------------------------------

FWD_BLOCK_M, FWD_BLOCK_N, FWD_WARPS, FWD_STAGES = (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)


def keep_fwd(bm: int, bn: int, w: int, s: int) -> bool:
    """64-row blocks: 4 warps only (one warp group per 64 rows); 128-key tiles: at most 3
    stages (two 128 x D key tiles per stage) and, with 128 rows, 8 warps (two 128 x 128 fp32
    score tiles); 32-key tiles: at least 3 stages (short steps need deeper prefetch)."""
    return not ((bm == 64 and w == 8) or (bn == 128 and (s > 3 or (bm == 128 and w == 4)))
                or (bn == 32 and s < 3))


FWD_GRID = [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
            for bm, bn, w, s in itertools.product(FWD_BLOCK_M, FWD_BLOCK_N, FWD_WARPS, FWD_STAGES)
            if keep_fwd(bm, bn, w, s)]

BWD_DK_TILES = ((16, 128), (32, 128), (64, 128), (32, 64), (64, 64))  # (BLOCK_M1, BLOCK_N1)
BWD_DQ_TILES = ((128, 32), (64, 64), (128, 64), (64, 32))  # (BLOCK_M2, BLOCK_N2), two_kernel
BWD_WARPS, BWD_STAGES = (4, 8), (1, 2, 3)


def keep_bwd(m1: int, n1: int, w: int, s: int) -> bool:
    """128-key dK tiles: 8 warps (the fp32 [128, D] dK accumulators); 64-key tiles: at least
    2 stages (short tiles need prefetch)."""
    return not ((n1 == 128 and w == 4) or (n1 == 64 and s == 1))


BWD_BASE = [(m1, n1, w, s) for (m1, n1), w, s in itertools.product(BWD_DK_TILES, BWD_WARPS, BWD_STAGES)
            if keep_bwd(m1, n1, w, s)]


def bwd_grid(default: dict, atomic: bool) -> list[dict]:
    """Each BWD_BASE entry with the transposed dQ tile; two_kernel adds the dQ-tile sweep."""
    grid = [{"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": n1, "BLOCK_N2": m1, "num_warps": w, "num_stages": s}
            for m1, n1, w, s in BWD_BASE]
    if not atomic:
        grid += [{**default, "BLOCK_M2": m2, "BLOCK_N2": n2} for m2, n2 in BWD_DQ_TILES]
    return grid


def cfg_key(cfg: dict, atomic: bool = False) -> tuple:
    """Identity of a config for deduplication (atomic_dq: without the unused dQ tile)."""
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1") + (() if atomic else ("BLOCK_M2", "BLOCK_N2"))
    return tuple(cfg.get(k) for k in keys + ("num_warps", "num_stages"))


def cfg_label(cfg: dict, atomic: bool = False) -> str:
    ws = f"w{cfg['num_warps']} s{cfg['num_stages']}"
    if "BLOCK_M" in cfg:
        return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} {ws}"
    dq = "" if atomic else f" dQ {cfg['BLOCK_M2']}x{cfg['BLOCK_N2']}"
    return f"dK {cfg['BLOCK_M1']}x{cfg['BLOCK_N1']}{dq} {ws}"


def cfg_literal(cfg: dict) -> str:
    """The config as an entry of codegen/attention_kl_configs.py's tables."""
    if "BLOCK_M" in cfg:
        return "_fwd({BLOCK_M}, {BLOCK_N}, {num_warps}, {num_stages})".format(**cfg)
    return "_bwd({BLOCK_M1}, {BLOCK_N1}, {BLOCK_M2}, {BLOCK_N2}, {num_warps}, {num_stages})".format(**cfg)


def table_configs(spec: dict, fam: str, causal: bool, n: Optional[int] = None) -> list[dict]:
    """The current table's configs for this family's key, default first (attention: at N = ``n``,
    which picks the short-causal table where it applies)."""
    import torch

    from fuser.codegen import attention as attn
    from fuser.codegen import attention_kl as akl

    f, dtype = FAMILIES[fam], getattr(torch, DTYPES[spec["dtype"]])
    if is_attention(fam):
        return attn.candidate_configs(head_dim=spec["dim"], head_dim_v=spec["dim"], dtype=dtype, device=spec["device"],
                                      causal="top_left" if causal else "none", kind="fwd", n_ctx=n)
    return akl.candidate_configs(head_dim1=spec["dim"], head_dim2=spec["dim"], dtype=dtype, device=spec["device"],
                                 causal="top_left" if causal else "none", kind=f["kind"],
                                 teacher_grad=f.get("needs_grad", BOTH)[0])


def candidates(spec: dict, fam: str, causal: bool, limit: int = 0, n: Optional[int] = None) -> list[tuple[dict, bool]]:
    """``(config, in current table)``, the table's default first, deduplicated (``n``: see
    :func:`table_configs`)."""
    atomic = FAMILIES[fam].get("bwd_mode") == "atomic_dq"
    table = table_configs(spec, fam, causal, n)
    grid = FWD_GRID if FAMILIES[fam]["kind"] == "fwd" else bwd_grid(table[0], atomic)
    out, seen = [], set()
    for i, cfg in enumerate(table + grid):
        if cfg_key(cfg, atomic) not in seen:
            seen.add(cfg_key(cfg, atomic))
            out.append((dict(cfg), i < len(table)))
    return out[:limit] if limit else out


# --------------------------------------------------------------------------------------------
# problems and calls (shared by this process and the precompile workers)
# --------------------------------------------------------------------------------------------

def problem(spec: dict, fam: str, causal: bool, n: int, cache: dict) -> dict:
    """Inputs (for a backward also g and the forward's statistics); ``cache`` keeps the last."""
    is_bwd = FAMILIES[fam]["kind"] == "bwd"
    kind = (FAMILIES[fam].get("kernel", "attention_kl"), causal, n, is_bwd)
    if kind in cache:
        return cache[kind]
    import torch

    from fuser.codegen import attention_kl as akl

    cache.clear()
    torch.manual_seed(spec["seed"] + n)
    shape = (spec["batch"], spec["heads"], n, spec["dim"])
    if is_attention(fam):
        q, k, v = (torch.randn(shape, dtype=getattr(torch, DTYPES[spec["dtype"]]), device=spec["device"])
                   for _ in range(3))
        cache[kind] = {"inputs": (q, k, v), "scale": spec["dim"] ** -0.5, "causal": "top_left" if causal else "none"}
        return cache[kind]
    q1, k1, q2, k2 = (torch.randn(shape, dtype=getattr(torch, DTYPES[spec["dtype"]]), device=spec["device"])
                      for _ in range(4))
    p = {"inputs": (q1, k1, q2, k2), "scale": spec["dim"] ** -0.5, "causal": "top_left" if causal else "none"}
    if is_bwd:
        p["g"] = torch.ones(shape[:3], dtype=torch.float32, device=spec["device"])
        for i, cfg in enumerate(table_configs(spec, "fwd", causal)):  # explicit configs: the first that runs
            try:
                p["stats"] = akl.forward(q1, k1, q2, k2, scale1=p["scale"], scale2=p["scale"], causal=p["causal"],
                                         need_stats=True, config=cfg)[1:]
                break
            except Exception:  # noqa: BLE001
                if i == len(table_configs(spec, "fwd", causal)) - 1:
                    raise
    cache[kind] = p
    return p


def make_call(p: dict, fam: str, cfg: dict):
    """A zero-argument callable: one launcher call with ``cfg``, returning its output tensors."""
    from fuser.codegen import attention as attn
    from fuser.codegen import attention_kl as akl

    f, s = FAMILIES[fam], p["scale"]
    if is_attention(fam):
        q, k, v = p["inputs"]

        def run_attention():
            return [t for t in attn.forward(q, k, v, scale=s, causal=p["causal"], need_lse=f["need_lse"], config=cfg)
                    if t is not None]
        return run_attention
    q1, k1, q2, k2 = p["inputs"]
    if f["kind"] == "fwd":
        def run():
            return [t for t in akl.forward(q1, k1, q2, k2, scale1=s, scale2=s, causal=p["causal"],
                                           need_stats=f["need_stats"], config=cfg) if t is not None]
        return run

    def run_bwd():
        return [t for t in akl.backward(p["g"], q1, k1, q2, k2, *p["stats"], scale1=s, scale2=s, causal=p["causal"],
                                        needs_grad=f["needs_grad"], bwd_mode=f["bwd_mode"], config=cfg)
                if t is not None]
    return run_bwd


def sdpa_call(p: dict):
    """SDPA on an attention problem's inputs (torch picks the backend), as a one-element list."""
    import torch.nn.functional as F

    q, k, v = p["inputs"]
    return lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=p["causal"] != "none", scale=p["scale"])]


_WORKER_CACHE: dict = {}


def _precompile(spec: dict, fam: str, causal: bool, n: int, cfg: dict) -> tuple[float, Optional[str]]:
    """In a worker: run ``cfg`` once, compiling it into Triton's disk cache; (seconds, error)."""
    t0 = time.perf_counter()
    try:
        make_call(problem(spec, fam, causal, n, _WORKER_CACHE), fam, cfg)()
        common.synchronize(spec["device"])
    except Exception as exc:  # noqa: BLE001
        return time.perf_counter() - t0, common.short_error(exc)
    return time.perf_counter() - t0, None


def compile_n(n: int) -> int:
    """A small N with the same Triton specialization as ``n`` (same N % 16)."""
    return n if n <= 512 else 256 + n % 16


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------

def rel_diff(out: list, ref: list) -> float:
    """Worst over tensors of max |out - ref| / max |ref| (equal infinities count as equal)."""
    import torch

    worst = 0.0
    for a, b in zip(out, ref):
        a, b = a.float(), b.float()
        fin = b[torch.isfinite(b)]
        e = torch.where(a == b, 0.0, (a - b).abs()).max().item() / max(fin.abs().max().item() if fin.numel() else 0, 1e-30)
        if not math.isfinite(e):
            return float("nan")
        worst = max(worst, e)
    return worst


def flops(args, fam: str, causal: bool, n: int) -> float:
    f = FAMILIES[fam]
    per_pair = 4 if f["kind"] == "fwd" else (12 if f["needs_grad"][0] else 8)  # attention forward: 4·D too
    return args.batch * args.heads * (n * (n + 1) / 2 if causal else float(n) * n) * per_pair * args.dim


def run_group(args, spec: dict, group: dict, futures: dict, state: dict) -> None:
    """Measure every config of one (family, causal, N), in order (the default first)."""
    fam, causal, n, recs = group["family"], group["causal"], group["N"], group["results"]
    ref: dict[str, Any] = {}
    p = None
    for i, rec in enumerate(recs):
        if state.get("broken"):
            rec["status"] = "skipped: CUDA context broken"
            continue
        if args.budget_s and common.elapsed_s() > args.budget_s:
            rec["status"], state["budget_hit"] = "skipped: time budget spent", True
            continue
        fut = futures.get((fam, causal, n, i))
        if fut is not None:
            try:
                left = max(1.0, args.budget_s - common.elapsed_s()) if args.budget_s else None
                rec["compile_s"], rec["compile_error"] = fut.result(timeout=left)
                state["precompiled"] = state.get("precompiled", 0) + 1
            except Exception as exc:  # noqa: BLE001 - a broken pool or a timeout: compile here
                state.setdefault("precompile_errors", []).append(common.short_error(exc, 200))
        try:
            p = p or problem(spec, fam, causal, n, state.setdefault("cache", {}))
        except Exception as exc:  # noqa: BLE001 - every config of the group fails the same way
            for r in recs[i:]:
                r["status"] = "error: statistics forward: " + common.short_error(exc).removeprefix("err: ")
            rec["error"] = common.describe_error(exc)
            break

        def check(out):
            if "out" not in ref:  # the default (or the first config that runs) is the reference
                ref["out"], group["reference"] = out, rec["config"]
                return 0.0
            return rel_diff(out, ref["out"])

        m = common.measure(make_call(p, fam, rec["cfg"]), spec["device"], args.warmup, args.rep, check=check,
                           timing=args.timing)
        rec.update(status="ok" if m.ok else m.status.replace("err:", "error:", 1), ms=m.ms, first_call_s=m.first_call_s,
                   timing=m.timing,
                   extra_mib=m.extra_mib, rel_diff=m.check, error=m.error, wrong=m.ok and not m.check <= args.tol,
                   tflops=group["flops"] / (m.ms * 1e-3) / 1e12 if m.ms else None)
        state["broken"] = bool(m.error and common.context_broken(m.error))
        res = common.fmt_ms(m.ms) + " ms" if m.ok else rec["status"][:40]
        print(f"[{common.elapsed_s():4.0f}s] {fam} {'causal' if causal else 'full'} N={n} {i + 1}/{len(recs)} "
              f"{rec['config']:<26} {res:>10}  first {m.first_call_s or 0:5.2f}s  compile {rec.get('compile_s') or 0:5.2f}s"
              f"  diff {common.fmt_err(m.check)}" + ("  WRONG" if rec["wrong"] else ""), file=sys.stderr, flush=True)
    d = recs[0]["ms"] if recs[0]["status"] == "ok" else None
    for rec in recs:
        rec["vs_default"] = d / rec["ms"] if (rec["ms"] and d) else None
    if is_attention(fam) and p is not None and not state.get("broken"):
        m = common.measure(sdpa_call(p), spec["device"], args.warmup, args.rep,
                           check=(lambda out: rel_diff(out, ref["out"])) if "out" in ref else None, timing=args.timing)
        group["sdpa"] = {"status": "ok" if m.ok else m.status, "ms": m.ms, "rel_diff": m.check, "timing": m.timing,
                         "tflops": group["flops"] / (m.ms * 1e-3) / 1e12 if m.ms else None}
        print(f"[{common.elapsed_s():4.0f}s] {fam} {'causal' if causal else 'full'} N={n} SDPA "
              f"{common.fmt_ms(m.ms) + ' ms' if m.ok else m.status[:40]:>10}  diff {common.fmt_err(m.check)}",
              file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def ranked(group: dict) -> list[dict]:
    ok = sorted((r for r in group["results"] if r["status"] == "ok"), key=lambda r: r["ms"])
    return ok + [r for r in group["results"] if r["status"] != "ok"]


def title(g: dict) -> str:
    return f"{g['family']}, {'causal' if g['causal'] else 'no mask'}, N={g['N']}"


def group_md(g: dict) -> str:
    rows = []
    for rank, r in enumerate(ranked(g), 1):
        ok = r["status"] == "ok"
        secs = [None if r.get(k) is None else f"{r[k]:.2f}" for k in ("compile_s", "first_call_s")]
        rows.append([rank if ok else "—", r["config"] + (" *" if r["in_table"] else "") + (" (default)" if r["default"] else ""),
                     common.fmt_ms(r["ms"]) if ok else r["status"].replace("|", "/"), common.fmt_sig(r.get("tflops")),
                     common.fmt_ratio(r.get("vs_default")), (secs[0] or "—") + (" err" if r.get("compile_error") else ""),
                     secs[1] or "—", common.fmt_num(r.get("extra_mib")), common.fmt_err(r.get("rel_diff")),
                     "WRONG" if r.get("wrong") else ("events: capture failed" if str(r.get("timing")).startswith("events (")
                                                     else "")])
    table = common.md_table(["rank", "config", "ms", "TFLOP/s", "vs default", "compile s", "first call s",
                             "extra MiB", "max rel diff", "flag"], rows, "rlrrrrrrrl")
    top = [cfg_literal(r["cfg"]) for r in ranked(g)[:5] if r["status"] == "ok" and not r.get("wrong")]
    ref = g.get("reference")
    ref = f"; diffs vs {ref} (the default failed)" if ref and ref != g["results"][0]["config"] else ""
    sdpa = g.get("sdpa")
    if sdpa:
        flag = " WRONG" if sdpa.get("rel_diff") is not None and not sdpa["rel_diff"] <= g["tol"] else ""
        ref += (f"; SDPA {common.fmt_ms(sdpa['ms'])} ms, its output vs the default's "
                f"{common.fmt_err(sdpa.get('rel_diff'))}{flag}" if sdpa["status"] == "ok" else f"; SDPA: {sdpa['status']}")
    return (f"## {title(g)}\n\n{len(g['results'])} configs, {common.fmt_sig(g['flops'] / 1e9)} GFLOP{ref}. "
            f"Fastest first, as table entries: `{', '.join(top) or '—'}`\n\n{table}")


def summary_md(groups: list[dict]) -> str:
    rows = []
    for g in groups:
        ok, d = [r for r in ranked(g) if r["status"] == "ok"], g["results"][0]
        b = next((r for r in ok if not r.get("wrong")), {})
        sdpa = g.get("sdpa") or {}
        rows.append([g["family"], "causal" if g["causal"] else "none", g["N"], f"{len(ok)}/{len(g['results'])}",
                     b.get("config", "—"), common.fmt_ms(b.get("ms")), common.fmt_sig(b.get("tflops")), d["config"],
                     common.fmt_ms(d["ms"]) if d["status"] == "ok" else d["status"][:40],
                     common.fmt_ratio(b.get("vs_default")),
                     common.fmt_ms(sdpa.get("ms")) if sdpa.get("status", "ok") == "ok" else sdpa["status"][:30],
                     common.fmt_ratio(common.ratio(sdpa.get("ms"), b.get("ms"))),
                     common.fmt_ratio(common.ratio(sdpa.get("ms"), d["ms"] if d["status"] == "ok" else None)),
                     sum(1 for r in g["results"] if r.get("wrong")) or ""])
    return common.md_table(["family", "causal", "N", "ok", "best config", "best ms", "best TFLOP/s",
                            "default config", "default ms", "speedup", "SDPA ms", "best vs SDPA", "default vs SDPA",
                            "WRONG"], rows, "llrrlrrlrrrrrr")


def legend(args) -> str:
    timed = "do_bench_cudagraph (GPU time, no launch cost)" if args.timing == "cudagraph" else "do_bench"
    return (f"B={args.batch}, H={args.heads}, D={args.dim}, dtype={args.dtype}; {timed} warmup={args.warmup} ms "
            f"rep={args.rep} ms (median). FLOPs per visible pair: 4·D fwd, 8·D bwd frozen, 12·D bwd both. "
            "SDPA (attention families only) = torch's scaled_dot_product_attention on the same inputs; "
            "best / default vs SDPA = SDPA ms / ms (>1: faster than SDPA). "
            "`*` = in the current table; vs default / speedup = default ms / ms (>1: faster than the default); "
            "compile s = a precompile worker's first call; first call s = this process's; max rel diff = "
            f"worst max|diff| / max|ref| vs the default's outputs, above {args.tol:g} reads WRONG. "
            "Details: docstring of benchmarks/tune_attention_kl.py.")


def write(args, meta: dict, groups: list[dict], state: dict, done: bool) -> list[Path]:
    notes = [f"- status: {'complete' if done else 'partial (run in progress or cut short)'}"]
    if state.get("budget_hit"):
        notes.append(f"- time budget of {args.budget_s:.0f} s was spent; later configs were skipped")
    if state.get("broken"):
        notes.append("- a CUDA error broke the context; later configs were skipped")
    if args.jobs:
        slow = sum(1 for g in groups for r in g["results"] if (r.get("first_call_s") or 0) > 1.0)
        notes.append(f"- precompiled by {args.jobs} workers: {state.get('precompiled', 0)} configs; first calls "
                     f"over 1 s here (cache misses?): {slow}")
    notes += [f"- precompile failed: {e}" for e in sorted(set(state.get("precompile_errors", [])))[:5]]
    errs = sorted({f"- {title(g)}, {r['config']}: {r['error'][:300]}".replace("\n", " ")
                   for g in groups for r in g["results"] if r.get("error")})
    parts = [common.header_md(TITLE, meta), *notes, "", legend(args), "", "## Summary", "", summary_md(groups)]
    parts += [x for g in groups for x in ("", group_md(g))] + (["", "## Errors", "", *errs] if errs else [])
    a = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data = {"meta": meta, "args": a, "complete": done, "precompiled": state.get("precompiled", 0), "groups": groups}
    return common.write_outputs(args.out, "\n".join(parts), data, args.copy_dir)


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", choices=tuple(FAMILIES), default=KL_FAMILIES,
                   help="default: the attention-KL ones (attn_fwd, attn_fwd_nolse: attention's forward)")
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="default 8192 (80 with --smoke)")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="default 16 (2 with --smoke)")
    p.add_argument("--dim", type=int, default=None, help="head dim, both sides (default 128; 16 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="do_bench warm-up ms (default 10)")
    p.add_argument("--rep", type=int, default=None, help="do_bench repetition ms (default 40)")
    p.add_argument("--timing", choices=common.TIMINGS, default="events",
                   help="events: do_bench (launch included); cudagraph: do_bench_cudagraph (GPU time)")
    p.add_argument("--max-configs", type=int, default=None, help="first K candidates per family (0: all; --smoke: 2)")
    p.add_argument("--jobs", type=int, default=None, help="precompile processes (GPU: min(12, cores - 4); 0: none)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no config after this many s (0: no limit)")
    p.add_argument("--out", type=Path, default=None, help="markdown path, JSON beside it (default in the out dir)")
    p.add_argument("--out-dir", default=os.environ.get("FUSER_BENCH_OUT_DIR", ""),
                   help="output folder (env FUSER_BENCH_OUT_DIR; default $TMPDIR/tune_attention_kl)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the candidates (H100 tables) and exit")
    p.add_argument("--smoke", action="store_true", help="N=80, H=2, D=16, fp32, 2 configs per family, on CPU")
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else DEFAULTS).items():
        setattr(a, k, v if getattr(a, k) is None else getattr(a, k))
    a.device = "cpu" if a.smoke and a.device == "auto" else a.device
    a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    a.tol = WRONG_TOL[a.dtype]
    a.copy_dir = a.out_dir if a.out else None
    a.out = a.out or Path(a.out_dir or os.path.join(tempfile.gettempdir(), "tune_attention_kl")) / "tune_attention_kl.md"
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    common.setup_environment(force_cpu=args.device == "cpu")
    import torch

    from fuser.codegen import attention_kl_configs

    device = "cuda" if (args.device != "cpu" and torch.cuda.is_available()) else "cpu"
    if args.device == "cuda" and device != "cuda":
        print("--device cuda: no CUDA device found", file=sys.stderr)
        return 2
    if args.list:
        attention_kl_configs.device_kind = lambda _dev: "sm90"  # the H100 tables, without a GPU (nothing is launched)
        from fuser.codegen import launch
        launch.device_kind = lambda _dev: "sm90"
    if args.jobs is None:
        args.jobs = min(12, max(1, (os.cpu_count() or 1) - 4)) if device == "cuda" and not args.list else 0
    spec = {"batch": args.batch, "heads": args.heads, "dim": args.dim, "dtype": args.dtype, "device": device,
            "seed": args.seed}
    groups = []
    for fam in args.families:
        for causal in args.causals:
            atomic = FAMILIES[fam].get("bwd_mode") == "atomic_dq"
            for n in args.seqs:
                cands = candidates(spec, fam, causal, args.max_configs, n if is_attention(fam) else None)
                groups.append({"family": fam, "causal": causal, "N": n, "flops": flops(args, fam, causal, n),
                               "tol": args.tol,
                               "results": [{"config": cfg_label(c, atomic), "cfg": c, "in_table": t, "default": i == 0,
                                            "status": "pending", "ms": None} for i, (c, t) in enumerate(cands)]})
    total = sum(len(g["results"]) for g in groups)
    if args.list:
        for g in (g for g in groups if is_attention(g["family"]) or g["N"] == args.seqs[0]):  # attention: per N
            at = f" N={g['N']}" if is_attention(g["family"]) else ""
            print(f"{g['family']} {'causal' if g['causal'] else 'none'}{at}: {len(g['results'])} configs: "
                  + ", ".join(r["config"] + ("*" if r["in_table"] else "") for r in g["results"]))
        print(f"{total} configs in all (* = in the current table)")
        return 0
    meta = common.env_header(device)
    print(f"{TITLE} on {meta['device']}: torch {meta['torch']}, triton {meta['triton']}; B={args.batch} "
          f"H={args.heads} D={args.dim} {args.dtype} N={args.seqs} causal={args.causals} families={args.families}: "
          f"{total} configs, {args.jobs} precompile jobs", flush=True)
    futures, pool, state = {}, None, {}
    if args.jobs:
        pool = cf.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=common.setup_environment, initargs=(device == "cpu",))
        for g in groups:  # in sweep order, so that the workers stay ahead of the measurements
            for i, r in enumerate(g["results"]):
                futures[(g["family"], g["causal"], g["N"], i)] = pool.submit(
                    _precompile, spec, g["family"], g["causal"], compile_n(g["N"]), r["cfg"])
    try:
        for k, g in enumerate(groups):
            run_group(args, spec, g, futures, state)
            write(args, meta, groups[: k + 1], state, done=False)
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    state.pop("cache", None)
    written = write(args, meta, groups, state, done=True)
    wrong = [f"{title(g)}: {r['config']}" for g in groups for r in g["results"] if r.get("wrong")]
    wrong += [f"{title(g)}: SDPA vs the default" for g in groups
              if (g.get("sdpa") or {}).get("rel_diff") is not None and not g["sdpa"]["rel_diff"] <= args.tol]
    if state.get("budget_hit"):
        print(f"NOTE: time budget of {args.budget_s:.0f} s was spent; later configs were skipped.")
    if wrong:
        print("!!! WRONG (vs the default config's outputs): " + "; ".join(wrong))
    print("\nwrote " + ", ".join(str(p) for p in written))
    print(f"total {common.elapsed_s():.0f} s\n\n## {TITLE} — {meta['device']}\n\n{legend(args)}\n\n"
          + summary_md(groups), flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
