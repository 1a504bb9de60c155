"""First-call (compile) time of a Hugging Face Llama: fuser vs Inductor, cold and warm caches.

Usage (on a GPU; each measurement runs in its own process)::

    python benchmarks/compile_time.py --workloads train --out-dir "$OUT"     # H100: ~3-4 min
    python benchmarks/compile_time.py --workloads prefill --out-dir "$OUT"   # H100: ~2-3 min
    python benchmarks/compile_time.py --smoke                                 # tiny prefill; CPU (interpreter)

What is measured (issue 11): the time users wait for the first call of ``torch.compile(model)``
on transformers' own ``LlamaForCausalLM`` built from a config (random weights, no download),
``attn_implementation="eager"`` (the written-out softmax attention fuser matches), ``--layers`` 4,
hidden 1024, intermediate 2816, 16 heads, 4 KV heads (``examples/h2o_llama.py``'s sizes),
vocab 32000, B=2, N=4096 (``--batch``, ``--seq``), bf16 (``--dtype``):

- ``train``: one training step, ``model.zero_grad(set_to_none=True); loss = model(ids,
  labels=ids, use_cache=False).loss; loss.backward()`` (``model.train()``; the backward is
  compiled by AOTAutograd during the first call).
- ``prefill``: the forward alone under ``torch.no_grad()`` (``model.eval()``, ``use_cache=False``):
  the logits of the whole prompt.

Backends (``--backends``): ``inductor`` (``torch.compile(model)``) and ``fuser``
(``torch.compile(model, backend="fuser")``, default options: the planner chooses per match).

Caches (``--caches``): ``cold``: fresh, empty ``TORCHINDUCTOR_CACHE_DIR``, ``FUSER_CACHE_DIR`` and
``TRITON_CACHE_DIR`` (one set per workload and backend, under ``--cache-root``, default a new
temporary directory); ``warm``: a second process reusing the set the cold one filled (Inductor's
FX-graph and AOTAutograd caches, Triton's kernel cache, fuser's rendered kernels and autotuning).
Every measurement runs in a fresh Python process (``--child``): imports, building the model, then
``torch.cuda.synchronize()``; the first call timed with a host clock up to a synchronize after it
(``first call s``: Dynamo, fuser's pass, Inductor, AOTAutograd, Triton's compiles and the step
itself); then a second call (``step ms``: the steady state). The process's imports and model
build are reported apart (``import s``, ``setup s``). fuser's report of the first call
(``fuser.report.collecting``) gives the regions fused, their plans and fuser's own compile phases
(``fuser compile s``, the sum of ``explain()``'s compile times; ``compile_fx s``: Inductor's
``compile_fx`` on fuser's graphs). Compiling fuser's kernels is in ``first call s`` and in none of
fuser's phases: on the GPU with static shapes Inductor compiles them inside ``compile_fx``
(opaque ops, with dynamic shapes or ``FUSER_OPAQUE_OPS=1``: Triton at their first launch).

Correctness: after the compiled steps, the same step runs eagerly on the same weights and input;
``err`` is the worst of ‖x − eager‖ / ‖eager‖ over the loss and the gradients (train) or the
logits (prefill); above 5e-2 (bf16, fp16; 1e-3 fp32) reads ``WRONG`` (exit status 1 for fuser).

Main table (``benchmarks/results/compile_time.md``): ``workload, shape, caches``; first call s of
inductor and fuser; ``fuser / inductor`` (issue 11's target: ≤ 1.1×, cold and warm, on the
training step: ✓/✗); ``to first result s`` of both (import + setup + first call: the whole wait,
whichever phase a backend loads its modules in: ``torch.compile`` with Inductor imports Inductor's
compile stack when called, ``import fuser`` when fuser is imported) and their ratio; fuser's own compile s; regions fused; ``step ms`` of both; fuser's err. The
details table has one row per (configuration, backend), with the first call's hits, misses and
bypasses of Inductor's FX-graph cache and AOTAutograd's cache (``caches hit/miss/bypass``, from
``torch._dynamo.utils.counters``: a warm process should show hits only; a miss there means a
cache key that changes between processes). A last table says where each first call went: torch's
``dynamo_timed`` phases (``torch._dynamo.utils.compile_times``: Dynamo's trace, AOTAutograd,
Inductor's lowering and codegen, waiting for its compile workers, ...; in seconds, nested, so a
column does not add up) side by side for the backends, and fuser's fit checks
(``launch.fit_check_stats``: compiles started, answers read from ``shared_memory.json``, seconds
the first call waited for a compile) and Inductor's analysis of which arguments fuser's kernels
write (``launch.access_analysis_stats``: times asked, answers from fuser's memo, seconds of the
analyses that ran). ``ms`` in the JSON (and the plot) is the
first call in ms.

Flags: ``--workloads {train,prefill}``, ``--backends``, ``--caches {cold,warm}`` (warm needs
cold first: the warm row reuses the cold row's directories), ``--layers``, ``--hidden``,
``--intermediate``, ``--heads``, ``--kv-heads``, ``--vocab``, ``--batch``, ``--seq``, ``--dtype``,
``--cache-root``, ``--child-timeout`` (s, default 240), ``--budget-s`` (default 300), ``--out``,
``--out-dir`` (or env ``FUSER_BENCH_OUT_DIR``), ``--fuser-option key=value``, ``--device``,
``--seed``, ``--profile TOP`` (cProfile each first call; its TOP functions by cumulative and own
time to ``compile_time_profile_<workload>_<caches>_<backend>.txt`` in ``--out-dir``, the whole
profile beside it as ``.prof`` for ``pstats``; slows the
first call), ``--smoke`` (1 layer, hidden 64, 4 heads, 2 KV heads, vocab 128, B=2, N=64, fp32, the
prefill workload unless ``--workloads`` says otherwise; fuser's kernels in Triton's interpreter;
results to ``compile_time_smoke.md``; on a 2-core CPU each process takes ~10-30 s, most of it
Inductor's C++ compile when cold).

Needs ``transformers`` (5.x, as the examples): without it every row reads ``skip``.

Time on an H100 (estimate from the issue's numbers, not yet run: a first call of the 4-layer
training step ~27 s with Inductor, ~35 s with fuser, cold): per process ~15 s of imports and
setup, the cold first call ~30 s, the warm one less, the eager check a few s: ``--workloads
train`` (4 processes) ~3-4 min, ``--workloads prefill`` ~2-3 min. Run them as two commands; the
budget guard (300 s) starts no new process after that and ``--child-timeout`` (240 s) bounds each,
so a command ends within ~9 min at worst (with ``timeout`` around it, the table written after
each row stays).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

WORKLOADS = ("train", "prefill")
BACKENDS = ("inductor", "fuser")
CACHES = ("cold", "warm")
WRONG_TOL = {"bf16": 5e-2, "fp16": 5e-2, "fp32": 1e-3}
TARGET_RATIO = 1.1  # issue 11: fuser's first call at most 1.1x Inductor's, cold and warm
RESULT_TAG = "COMPILE_TIME_RESULT "
#: the Llama's sizes (common.add_llama_args): examples/h2o_llama.py's, and a tiny one for --smoke
LLAMA = {"layers": 4, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "vocab": 32000, "seq": 4096}
LLAMA_SMOKE = {"layers": 1, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocab": 128, "seq": 64}
CACHE_VARS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "FUSER_CACHE_DIR": "fuser", "TRITON_CACHE_DIR": "triton"}


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None,
                   help="default train prefill (prefill with --smoke)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    common.add_llama_args(p, LLAMA, LLAMA_SMOKE)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default=None, help="default bf16 (fp32 with --smoke)")
    p.add_argument("--cache-root", default=None, help="where the cache directories go (default: a new temp dir)")
    p.add_argument("--child-timeout", type=float, default=240.0, help="seconds per measuring process (default 240)")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="cProfile each first call and write its TOP functions (by cumulative and own time) "
                        "to compile_time_profile_<workload>_<caches>_<backend>.txt in --out-dir (default: beside "
                        "--out); the profiler slows the first call (~1.5x): compare timings without it")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one measurement (JSON spec)
    common.add_driver_args(p, budget_s=300.0, out_name="compile_time")
    a = p.parse_args(argv)
    small = a.smoke
    common.finish_driver_args(a, out_name="compile_time")
    common.finish_llama_args(a, LLAMA, LLAMA_SMOKE)
    a.dtype = a.dtype or ("fp32" if small else "bf16")
    a.workloads = a.workloads or (["prefill"] if small else list(WORKLOADS))
    return a


# --------------------------------------------------------------------------------------------
# one measurement, in its own process
# --------------------------------------------------------------------------------------------

def run_child(spec: dict) -> dict:
    """Build the model, compile it with ``spec["backend"]``, time the first and the second call
    of ``spec["workload"]``, check against eager; returns the result record's fields."""
    t_start = time.perf_counter()
    common.setup_environment(force_cpu=spec["device"] == "cpu")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    fuser = None
    if spec["backend"] == "fuser":
        import fuser
        import fuser.report  # noqa: F401
    out: dict[str, Any] = {"import_s": time.perf_counter() - t_start}
    t0 = time.perf_counter()
    device = "cuda" if spec["device"] == "cuda" else "cpu"
    dtype = getattr(torch, common.DTYPES[spec["dtype"]])
    torch.manual_seed(spec["seed"])
    model = transformers.LlamaForCausalLM(common.llama_config(spec, "eager")).to(device, dtype)
    train = spec["workload"] == "train"
    model.train(train)
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), device=device)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(m):
        if train:
            model.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return (loss.detach().float(), *[p.grad for p in params])
        with torch.no_grad():
            return (m(input_ids=ids, use_cache=False).logits,)

    kw: dict[str, Any] = {}
    if fuser is not None:
        opts = dict(spec["fuser_options"])
        if device == "cpu":
            opts.setdefault("fuser.interpret", True)
        kw = {"backend": "fuser", "options": opts or None}
    compiled = torch.compile(model, **kw)
    common.synchronize(device)
    out["setup_s"] = time.perf_counter() - t0
    g0 = common.graphs_compiled()
    before = cache_counters()
    profiler = None
    if spec.get("profile_path"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    if fuser is not None:
        with fuser.report.collecting() as rep:
            got = step(compiled)
    else:
        rep = None
        got = step(compiled)
    common.synchronize(device)
    out["first_call_s"] = time.perf_counter() - t0
    out["dynamo_phases_s"] = dynamo_phases()
    if fuser is not None:
        from fuser.codegen import launch

        out["fit_checks"] = launch.fit_check_stats()
        out["access_analysis"] = launch.access_analysis_stats()
    if profiler is not None:
        profiler.disable()
        write_profile(profiler, spec["profile_path"], spec.get("profile_top", 60))
        out["profile"] = spec["profile_path"]
    after = cache_counters()
    out["cache_counters"] = {k: after[k] - before.get(k, 0) for k in after}
    out["graphs_compiled"] = common.graphs_compiled() - g0 if g0 >= 0 else None
    got = tuple(x.detach().clone() if x is not None else None for x in got)
    common.synchronize(device)
    t0 = time.perf_counter()
    step(compiled)
    common.synchronize(device)
    out["step_ms"] = (time.perf_counter() - t0) * 1e3
    if rep is not None:
        out.update(fuser_outcome(rep))
    want = step(model)
    pairs = [(a, b) for a, b in zip(got, want) if a is not None and b is not None]
    out["rel_err_out"] = common.rel_err(*zip(*pairs[:1]))
    out["rel_err_grads"] = common.rel_err(*zip(*pairs[1:])) if train and len(pairs) > 1 else None
    errs = [e for e in (out["rel_err_out"], out["rel_err_grads"]) if e is not None]
    out["rel_err"] = float("nan") if any(e != e for e in errs) else max(errs)
    out["process_s"] = time.perf_counter() - t_start
    return out


#: Inductor's FX-graph cache and AOTAutograd's cache: hits, misses and bypasses in
#: ``torch._dynamo.utils.counters`` (what a warm process should show: hits only).
CACHE_COUNTERS = {
    "fx_hit": ("inductor", "fxgraph_cache_hit"), "fx_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"), "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"), "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
}


def dynamo_phases() -> dict:
    """Seconds per phase that torch times with ``dynamo_timed`` (``torch._dynamo.utils.compile_times``,
    summed over the process's compiles so far: Dynamo's trace, AOTAutograd, Inductor's lowering,
    codegen, waiting for its compile workers...); empty where this torch does not give them."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        return {n: float(v) for n, v in zip(names, values)}
    except Exception:  # noqa: BLE001 - an account, not the measurement
        return {}


def cache_counters() -> dict:
    """The counts of :data:`CACHE_COUNTERS` so far in this process."""
    from torch._dynamo.utils import counters

    return {k: int(counters[group][name]) for k, (group, name) in CACHE_COUNTERS.items()}


def cache_cell(c: Optional[dict]) -> str:
    """``FX h/m/b · AOT h/m/b``: the first call's cache hits, misses and bypasses."""
    if not c:
        return "—"
    return (f"FX {c.get('fx_hit', 0)}/{c.get('fx_miss', 0)}/{c.get('fx_bypass', 0)} · "
            f"AOT {c.get('aot_hit', 0)}/{c.get('aot_miss', 0)}/{c.get('aot_bypass', 0)}")


def write_profile(profiler, path: str, top: int) -> None:
    """The ``top`` functions of a cProfile of the first call, by cumulative and by own time, to
    ``path``; the whole profile beside it (``<path without .txt>.prof``, for ``pstats``: callers
    and callees)."""
    import io
    import pstats

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(Path(path).with_suffix(".prof")))
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    Path(path).write_text(buf.getvalue())


def to_first_result(r: Optional[dict]) -> Optional[float]:
    """import s + setup s + first call s of one record (seconds), or None when a part is missing."""
    if not r or r.get("status") != "ok":
        return None
    parts = [r.get("import_s"), r.get("setup_s"), r.get("first_call_s")]
    return None if any(p is None for p in parts) else float(sum(parts))


def total_cell(r: Optional[dict]) -> str:
    t = to_first_result(r)
    return "—" if t is None else f"{t:.2f}"


def fuser_outcome(rep) -> dict:
    """Regions fused, plans and fuser's compile times from the first call's report."""
    fused = list(rep.fused)
    plans = sorted({m.plan.name for m in fused if m.plan is not None})
    times = list(rep.compile_times)
    ind = [t.inductor_ms for t in times if t.inductor_ms is not None]
    phases: dict[str, float] = {}
    for t in times:
        for name, ms in t.phases.items():
            phases[name] = phases.get(name, 0.0) + ms
    note = (f"fused {len(fused)} of {len(rep.matches)} matches ({', '.join(plans) or '-'}); "
            f"{len(rep.rejected)} near-misses; {rep.graphs} graphs")
    return {"fused": len(fused), "matches": len(rep.matches), "plan": ", ".join(plans), "note": note,
            "fuser_compile_s": sum(t.total_ms for t in times) / 1e3, "compile_fx_s": sum(ind) / 1e3 if ind else None,
            "phases_ms": phases}


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    result = run_child(spec)
    print(RESULT_TAG + json.dumps(result, default=str), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# the benchmark (the parent process)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    workload: str
    cache: str

    @property
    def label(self) -> str:
        return f"{self.workload} {self.cache} caches"


class CompileTimeBenchmark(common.Benchmark):
    """Groups: one per workload; configurations: the cache states (cold first); implementations:
    the backends. Every measurement is a child process (``--child``)."""

    title = "fuser compile-time benchmark (first call)"
    name = "compile time"
    label_width = 24
    needs_fuser = False  # the parent compiles nothing

    def __init__(self, args) -> None:
        super().__init__(args)
        self.root = Path(args.cache_root) if args.cache_root else Path(tempfile.mkdtemp(prefix="fuser-compile-time-"))

    def banner(self) -> str:
        a, m = self.args, self.meta
        return (f"compile-time benchmark on {m['device']}: torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}; "
                f"workloads={a.workloads} backends={a.backends} caches={a.caches}; {self.shape()}; "
                f"cache root {self.root}")

    def shape(self) -> str:
        a = self.args
        return (f"Llama {a.layers} layers, hidden {a.hidden}, {a.heads} heads / {a.kv_heads} KV, "
                f"vocab {a.vocab}, B={a.batch}, N={a.seq}, {a.dtype}")

    def groups(self):
        a = self.args
        return [(w, [Config(w, c) for c in CACHES if c in a.caches]) for w in WORKLOADS if w in a.workloads]

    def implementations(self, group) -> dict[str, common.Impl]:
        return {b: common.Impl(lambda run: None, report=False) for b in BACKENDS if b in self.args.backends}

    def inputs(self, cfg):
        return None

    def new_record(self, impl: str, run) -> dict:
        return {**super().new_record(impl, run), "import_s": None, "setup_s": None, "step_ms": None,
                "fused": None, "matches": None, "plan": "", "fuser_compile_s": None, "compile_fx_s": None,
                "phases_ms": None, "rel_err_out": None, "rel_err_grads": None, "process_s": None,
                "cache_dirs": None, "cache_counters": None, "profile": None}

    def cache_env(self, cfg: Config, backend: str) -> dict:
        base = self.root / f"{cfg.workload}_{backend}"
        return {var: str(base / sub) for var, sub in CACHE_VARS.items()}

    def measure_impl(self, run, name, impl) -> Optional[dict]:
        """One child process: skipped (budget, no transformers, warm without its cold run) or
        measured; its record."""
        return self.finish(run, name, self.start(run, name))

    def start(self, run, name: str) -> tuple:
        """``(record, process or None, start time)``: the child started, or a skipped record."""
        a, cfg = self.args, run.cfg
        rec = self.new_record(name, run)
        why = self.skip_reason()
        if why is None and importlib.util.find_spec("transformers") is None:
            why = "transformers is not installed (pip install transformers): no HF Llama to compile"
        env_dirs = self.cache_env(cfg, name)
        if why is None and cfg.cache == "warm" and not self.state.get(("cold", cfg.workload, name)):
            why = "no cold run filled these caches first (run --caches cold warm)"
        if why is None and cfg.cache == "cold" and any(Path(d).exists() and any(Path(d).iterdir())
                                                        for d in env_dirs.values()):
            why = f"{self.root} already holds caches for this row: not cold (give a new --cache-root)"
        if why is not None:
            rec.update(status="skip", note=why)
            return rec, None, 0.0
        for d in env_dirs.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        spec = {"workload": cfg.workload, "backend": name, "device": self.device, "dtype": a.dtype, "seed": a.seed,
                "layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate, "heads": a.heads,
                "kv_heads": a.kv_heads, "vocab": a.vocab, "batch": a.batch, "seq": a.seq,
                "fuser_options": a.fuser_options}
        if a.profile:
            folder = Path(a.out_dir) if a.out_dir else Path(a.out).parent
            spec["profile_path"] = str(folder / f"compile_time_profile_{cfg.workload}_{cfg.cache}_{name}.txt")
            spec["profile_top"] = a.profile
        env = common.child_env(env_dirs)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
        rec["cache_dirs"] = env_dirs
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=str(common.REPO_ROOT))
        return rec, proc, time.perf_counter()

    def finish(self, run, name: str, child: tuple) -> dict:
        """Wait for a child started by :meth:`start` and fill its record from what it printed."""
        a, cfg = self.args, run.cfg
        rec, proc, t0 = child
        if proc is not None:
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, a.child_timeout - (time.perf_counter() - t0)))
                result, failure = common.child_outcome(proc.returncode, stdout, stderr, RESULT_TAG)
                if result is None:
                    rec.update(failure)
                else:
                    rec.update(result)
                    rec["ms"] = rec["first_call_s"] * 1e3
                    if cfg.cache == "cold":
                        self.state[("cold", cfg.workload, name)] = True
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                rec.update(status=f"timeout ({a.child_timeout:.0f} s)",
                           error=f"child timed out after {a.child_timeout:.0f} s")
            rec["process_s"] = rec.get("process_s") or time.perf_counter() - t0
        self.progress(run, name, rec)
        return rec

    def progress(self, run, name, rec) -> None:
        if rec["status"] != "ok":
            print(f"  {run.cfg.label:<{self.label_width}} {name:<9} {rec['status']}  {rec['note'] or ''}", flush=True)
            return
        err = rec.get("rel_err")
        print(f"  {run.cfg.label:<{self.label_width}} {name:<9} first call {rec['first_call_s']:7.2f} s  "
              f"step {rec['step_ms']:8.1f} ms  imports {rec['import_s']:5.1f} s"
              + (f"  fuser's own {rec['fuser_compile_s']:.2f} s" if rec.get("fuser_compile_s") is not None else "")
              + (f"  err {common.fmt_err(err)}" if err is not None else "") + f"  {rec['note'] or ''}", flush=True)

    # -- derived numbers and tables ------------------------------------------------------
    def is_wrong(self, r: dict) -> bool:
        e = r.get("rel_err")
        return e is not None and not (e <= WRONG_TOL[self.args.dtype])

    def summarize(self, cfg: Config, records: dict) -> dict:
        for r in records.values():
            r["wrong"] = self.is_wrong(r)
        s = {b: r["first_call_s"] for b, r in records.items() if r.get("status") == "ok"}
        total = {b: to_first_result(r) for b, r in records.items() if to_first_result(r) is not None}
        return {"N": self.args.seq, "workload": cfg.workload, "cache": cfg.cache,
                "fuser": {"ratio": common.ratio(s.get("fuser"), s.get("inductor")), "shape": self.shape(),
                          "total_ratio": common.ratio(total.get("fuser"), total.get("inductor"))}}

    def main_table(self) -> str:
        headers = ["workload", "caches", "inductor first call s", "fuser first call s", "fuser / inductor",
                   "to first result s inductor / fuser", "fuser / inductor (to first result)",
                   "fuser's own compile s", "fused", "step ms inductor / fuser", "fuser err"]
        body = []
        for cfg, recs, s in self.rows:
            ind, fz = recs.get("inductor"), recs.get("fuser")
            ratio = s["fuser"]["ratio"]
            mark = "" if ratio is None else (" ✓" if ratio <= TARGET_RATIO else " ✗")
            body.append([cfg.workload, cfg.cache, s_cell(ind), s_cell(fz),
                         (common.fmt_ratio(ratio) + mark) if ratio is not None else "—",
                         f"{total_cell(ind)} / {total_cell(fz)}",
                         common.fmt_ratio(s["fuser"]["total_ratio"]) if s["fuser"].get("total_ratio") is not None else "—",
                         f"{fz['fuser_compile_s']:.2f}" if fz and fz.get("fuser_compile_s") is not None else "—",
                         f"{fz['fused']} of {fz['matches']}" if fz and fz.get("fused") is not None else "—",
                         f"{ms_cell(ind)} / {ms_cell(fz)}",
                         (("WRONG " if fz.get("wrong") else "") + common.fmt_err(fz.get("rel_err"))) if fz else "—"])
        return common.md_table(headers, body, "ll" + "r" * 6 + "lrr")

    def details_table(self) -> str:
        headers = ["workload", "caches", "backend", "first call s", "step ms", "import s", "setup s",
                   "fuser's own s", "compile_fx s", "caches hit/miss/bypass", "err loss-or-logits / grads", "note"]
        body = []
        for cfg, recs, _ in self.rows:
            for name, r in recs.items():
                errs = common.fmt_err(r.get("rel_err_out"))
                if r.get("rel_err_grads") is not None:
                    errs += " / " + common.fmt_err(r["rel_err_grads"])
                body.append([cfg.workload, cfg.cache, name, common.first_call_cell(r), ms_cell(r),
                             sec(r.get("import_s")), sec(r.get("setup_s")), sec(r.get("fuser_compile_s")),
                             sec(r.get("compile_fx_s")), cache_cell(r.get("cache_counters")),
                             ("WRONG " if r.get("wrong") else "") + errs,
                             common.note_cell(r) + (" (profiled: slower)" if r.get("profile") else "")])
        return common.md_table(headers, body, "lll" + "r" * 6 + "lll")

    def phases_table(self) -> str:
        """fuser's compile phases (ms, summed over the graphs of the first call) per fuser run."""
        runs = [(cfg, r) for cfg, recs, _ in self.rows for n, r in recs.items()
                if n == "fuser" and r.get("phases_ms")]
        if not runs:
            return ""
        names = list(dict.fromkeys(p for _, r in runs for p in r["phases_ms"]))
        body = [[cfg.workload, cfg.cache] + [common.fmt_sig(r["phases_ms"].get(p)) for p in names]
                + [common.fmt_sig(r["fuser_compile_s"] * 1e3)] for cfg, r in runs]
        return ("fuser's compile phases (ms; `fuser.report.CompileTimes`, summed over the first call's graphs; "
                "compiling fuser's kernels is in none: Inductor's compile_fx compiles them on the GPU):\n\n"
                + common.md_table(["workload", "caches"] + names + ["total"], body, "ll" + "r" * (len(names) + 1)))

    def where_table(self, min_s: float = 0.1) -> str:
        """Where each first call went: torch's ``dynamo_timed`` phases (s) per run, one column a
        (workload, caches, backend), the phases above ``min_s`` in some run, longest first; and
        fuser's fit checks (compiles started, answers from disk, seconds the first call waited)."""
        runs = [(f"{cfg.workload} {cfg.cache} {n}", r) for cfg, recs, _ in self.rows for n, r in recs.items()
                if r.get("dynamo_phases_s")]
        if not runs:
            return ""
        names = [p for p in dict.fromkeys(p for _, r in runs for p in r["dynamo_phases_s"])
                 if max(r["dynamo_phases_s"].get(p, 0.0) for _, r in runs) >= min_s]
        names.sort(key=lambda p: -max(r["dynamo_phases_s"].get(p, 0.0) for _, r in runs))
        body = [[f"`{p}`"] + [sec(r["dynamo_phases_s"].get(p)) for _, r in runs] for p in names]
        fits = [r.get("fit_checks") for _, r in runs]
        if any(fits):
            body.append(["fuser's fit checks: compiles / from disk / waited s"]
                        + [f"{f['compiles']} / {f['disk']} / {f['wait_s']:.2f}" if f else "—" for f in fits])
        access = [r.get("access_analysis") for _, r in runs]
        if any(access):
            body.append(["Inductor's access analysis of fuser's kernels: asked / from fuser's memo / s run"]
                        + [f"{a['calls']} / {a['memo']} / {a['run_s']:.2f}" if a else "—" for a in access])
        return ("Where the first call goes (s; torch's `dynamo_timed` phases, `torch._dynamo.utils.compile_times`, "
                "summed over the process's compiles; phases nest, so columns do not add up; "
                f"phases of {min_s:g} s or more in some run):\n\n"
                + common.md_table(["phase"] + [name for name, _ in runs], body, "l" + "r" * len(runs)))

    def render(self, done: bool) -> tuple[str, str, str]:
        md, stdout, main = super().render(done)
        for extra in (self.phases_table(), self.where_table()):
            if extra:
                md += "\n\n" + extra
                stdout += "\n\n" + extra
        return md, stdout, main

    def legend(self) -> str:
        a = self.args
        return (
            f"{self.shape()}; attn_implementation='eager'. train = zero_grad + forward with labels + backward; "
            "prefill = forward under no_grad. Each cell is a fresh process: cold = empty TORCHINDUCTOR_CACHE_DIR, "
            "FUSER_CACHE_DIR and TRITON_CACHE_DIR; warm = a second process reusing them. first call s = host "
            "time of the first call to a synchronize after it (Dynamo, fuser's pass, Inductor, AOTAutograd, Triton "
            f"compiles, the step). fuser / inductor: target ≤ {TARGET_RATIO:g}× (✓/✗). to first result s = import s + "
            "setup s + first call s: what the process waits for before the first result (`torch.compile(model)` "
            "with Inductor imports Inductor's compile stack in setup, when it is called; `import fuser` imports "
            "it then). fuser's own compile s: "
            "fuser's compile phases (explain()'s compile time; compiling fuser's kernels is in none of them: "
            "on the GPU Inductor compiles them inside compile_fx, in the first call). step ms = the second call. err = worst "
            "‖x − eager‖ / ‖eager‖ over the loss and gradients (train) or the logits (prefill); above "
            f"{WRONG_TOL[a.dtype]:g} reads WRONG. Columns: docstring of benchmarks/compile_time.py.")

    def notes(self) -> list[str]:
        return super().notes() + [f"- cache directories under `{self.root}`"]

    def wrong(self) -> list[str]:
        return [f"fuser at {cfg.label}" for cfg, recs, _ in self.rows if (recs.get("fuser") or {}).get("wrong")]

    def final_lines(self) -> list[str]:
        lines = super().final_lines()
        wrong = self.wrong()
        if wrong:
            lines.append("!!! WRONG (err vs eager above the tolerance): " + "; ".join(wrong))
        return lines


def s_cell(r: Optional[dict]) -> str:
    if r is None:
        return "—"
    if r["status"] != "ok":
        return r["status"].split(":")[0].split(" (")[0]
    return f"{r['first_call_s']:.2f}" + (" WRONG" if r.get("wrong") else "")


def ms_cell(r: Optional[dict]) -> str:
    return common.fmt_ms(r.get("step_ms")) if r and r.get("status") == "ok" else "—"


def sec(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}"


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a.child)
    return CompileTimeBenchmark(a).main()


if __name__ == "__main__":
    sys.exit(main())
