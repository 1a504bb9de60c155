"""Shared helpers for fuser's benchmark scripts (``benchmarks/<pattern>.py``).

Nothing here is specific to one pattern:

- :func:`setup_environment` -- call before importing triton or fuser: puts the repository root
  on ``sys.path`` (so a source checkout works without ``pip install``) and, without a GPU,
  turns on Triton's interpreter so that fuser's kernels run on CPU tensors.
- :func:`fresh_function` -- a copy of a Python function with its own code object. Dynamo keeps
  its compiled-code cache on the code object, so compiling the *same* function several times
  (other backend, other grad mode, other head dim) would share one cache and run into
  ``recompile_limit`` (after which Dynamo silently runs the function eagerly). A fresh copy per
  compiled variant keeps each variant's cache to itself.
- :func:`measure` -- the measurement protocol for one implementation on one configuration:
  first call (compiles; timed with a host clock after a synchronize, reported separately),
  a check of its outputs, a memory probe (peak allocated during one call minus what was
  allocated before it), and ``triton.testing.do_bench(..., return_mode="median")``.
  Any exception is caught and recorded as ``OOM`` or ``err: <message>``.
- :func:`env_header`, :func:`md_table`, :func:`write_outputs`, number formatting.
- :class:`Benchmark`, the driver every ``benchmarks/<pattern>.py`` runs on: a grid of
  configurations (in groups that share compiled functions) times a dict of implementations
  (:class:`Impl`: name -> a builder returning the timed region, or why it is skipped), each
  measured with :func:`measure` and checked against a reference; after every configuration
  the rows are rewritten as markdown + JSON (+ plot at the end) by :func:`write_outputs`, with
  the environment header, so a run cut short by an error or its time budget keeps what it
  measured. A script supplies the grid, the implementations, the reference and the tables.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
START_TIME = time.perf_counter()

#: ``--dtype`` choices -> torch dtype names.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

#: Peak rates of an H100 SXM5 (80 GB HBM3), from NVIDIA's datasheet: HBM3 bandwidth and dense
#: (no sparsity) fp16/bf16 tensor-core throughput. Floors computed from these are what the
#: hardware could do at best; ``attention.py`` and ``attention_kl.py`` default to rates measured
#: on the H100 instead (790 TFLOP/s bf16, 3.0 TB/s).
H100_PEAK_TBPS = 3.35
H100_PEAK_TFLOPS_FP16 = 989.0


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------

def setup_environment(force_cpu: bool = False) -> None:
    """Prepare the process before ``triton``/``fuser`` are imported.

    Puts the repository root first on ``sys.path`` (``python benchmarks/x.py`` only puts
    ``benchmarks/`` there) and sets ``TRITON_INTERPRET=1`` when no CUDA device will be used,
    which Triton reads once at import time.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import torch

    if force_cpu or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def elapsed_s() -> float:
    """Seconds since this module was imported (the script's start, for time budgets)."""
    return time.perf_counter() - START_TIME


def env_header(device: str, argv: Optional[Sequence[str]] = None) -> dict:
    """Device, library versions, date and command line, for the top of a results file."""
    import torch
    import triton

    if device == "cuda":
        dev_name = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        dev_mem = f"{props.total_memory / 2**30:.1f} GiB"
    else:
        dev_name, dev_mem = f"CPU ({platform.processor() or platform.machine()})", "-"
    argv = list(sys.argv if argv is None else argv)
    return {
        "device": dev_name,
        "device_memory": dev_mem,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "-",
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(a) for a in argv),
        "allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }


def header_md(title: str, meta: dict) -> str:
    lines = [f"# {title}", ""]
    for k in ("device", "device_memory", "torch", "triton", "cuda", "python", "date", "command"):
        lines.append(f"- {k}: `{meta[k]}`" if k == "command" else f"- {k}: {meta[k]}")
    if meta.get("triton_interpret") == "1":
        lines.append("- TRITON_INTERPRET=1 (no GPU: fuser's kernels ran in Triton's interpreter; times are meaningless)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# compiled variants
# --------------------------------------------------------------------------------------------

def fresh_function(fn: Callable, name: str) -> Callable:
    """A copy of ``fn`` (same globals, closure, defaults) with its own code object named
    ``name``, so that Dynamo compiles and caches it separately from every other copy."""
    code = fn.__code__
    kw: dict[str, Any] = {"co_name": name}
    if hasattr(code, "co_qualname"):  # Python >= 3.11
        kw["co_qualname"] = name
    new = types.FunctionType(code.replace(**kw), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def raise_recompile_limit(limit: int = 64) -> None:
    """Let a variant recompile for each shape when shapes are static (``--shapes static``)."""
    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, name):
            try:
                setattr(dcfg, name, max(getattr(dcfg, name), limit))
            except Exception:
                pass
    if hasattr(dcfg, "accumulated_recompile_limit"):
        dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 4 * limit)


def graphs_compiled() -> int:
    """How many graphs Dynamo has compiled so far in this process (for recompile counts)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return -1


# --------------------------------------------------------------------------------------------
# timing and memory
# --------------------------------------------------------------------------------------------

def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


#: How a CUDA implementation is timed: ``"events"`` (``triton.testing.do_bench``: each call
#: launched from Python between CUDA events, L2 flushed before each; host launch cost included
#: where it exceeds the GPU time) or ``"cudagraph"`` (``triton.testing.do_bench_cudagraph``: the
#: calls captured once in a CUDA graph and replayed: GPU time alone, no host launch cost, no L2
#: flush between calls).
TIMINGS = ("events", "cudagraph")


def bench_ms(fn: Callable[[], Any], device: str, warmup: int, rep: int, timing: str = "events") -> float:
    """Median time of ``fn()`` in ms: on CUDA as ``timing`` says (:data:`TIMINGS`); on CPU, a
    host clock around each call (for smoke runs only)."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    if device == "cuda":
        import triton.testing

        synchronize(device)
        if timing == "cudagraph":
            return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    times = []
    t_end = time.perf_counter() + rep / 1e3
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 100):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def extra_mib(fn: Callable[[], Any], device: str) -> Optional[float]:
    """Peak memory allocated during one call of ``fn`` minus the memory allocated just before
    it, in MiB (so inputs, which already exist, are not counted; outputs and temporaries are).
    ``None`` on CPU."""
    if device != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def kernel_times_us(fn: Callable[[], Any], calls: int = 5) -> dict:
    """Device time per call of every kernel ``fn`` launches, in µs (``torch.profiler``, CUDA
    activity, ``calls`` calls after the caller's warm-up): ``{kernel name: µs per call}``."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us > 0:
            per[e.key] = us / calls
    return per


def free_memory(device: str, collect: bool = False) -> None:
    """Return cached device memory to the driver; ``collect`` also runs the garbage collector
    first (slow, ~0.2 s with torch loaded: only after errors, whose tracebacks hold tensors)."""
    if collect:
        gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception behind wrappers such as Dynamo's ``BackendCompilerFailed``."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return exc


def describe_error(exc: BaseException, limit: int = 2000) -> str:
    """``Type: message`` of the exception, with the root cause's when it is wrapped."""
    root = root_cause(exc)
    text = f"{type(exc).__name__}: {exc}"
    if root is not exc:
        text = f"{type(root).__name__}: {root}  [via {type(exc).__name__}]"
    return text[:limit]


def short_error(exc: BaseException, limit: int = 60) -> str:
    """``OOM`` for out-of-memory errors, else ``err: <first line of the root cause>``."""
    import torch

    root = root_cause(exc)
    msg = f"{type(root).__name__}: {root}".strip()
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None)
    if isinstance(exc, oom_types) or isinstance(root, oom_types) or "out of memory" in msg.lower():
        return "OOM"
    first = next((ln for ln in msg.splitlines() if ln.strip()), msg)
    return "err: " + (first if len(first) <= limit else first[: limit - 1] + "…")


def context_broken(message: str) -> bool:
    """After these errors the CUDA context is unusable: stop measuring, keep what we have."""
    m = message.lower()
    return any(s in m for s in ("illegal memory access", "device-side assert", "unspecified launch failure",
                                "misaligned address", "illegal instruction"))


@dataclasses.dataclass
class Measurement:
    """One implementation on one configuration. ``status`` is ``ok``, ``OOM``, ``err: ...``
    or ``skipped: ...``; ``check`` holds whatever the caller's check function returned."""

    status: str = "ok"
    ms: Optional[float] = None
    extra_mib: Optional[float] = None
    first_call_s: Optional[float] = None
    graphs_compiled: Optional[int] = None
    check: Any = None
    error: Optional[str] = None
    first_context: Any = None
    timing: Optional[str] = None  # how ``ms`` was timed (see :data:`TIMINGS`)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def measure(run_once: Callable[[], Any], device: str, warmup: int, rep: int,
            check: Optional[Callable[[Any], Any]] = None,
            on_first: Optional[Callable[[], Any]] = None, timing: str = "events") -> Measurement:
    """Measure one implementation on one configuration.

    ``run_once()`` does the whole timed region (e.g. forward, or forward + backward) and
    returns what ``check`` should look at. Steps: synchronize; first call, timed with a host
    clock (includes compilation: this is the "first call s" users feel) and checked; one
    memory-probe call; then ``do_bench`` (median), or with ``timing="cudagraph"``
    ``do_bench_cudagraph`` — if the calls cannot be captured (a host synchronisation, say), they
    are timed with events instead and ``Measurement.timing`` says so. ``on_first``, a
    context-manager factory, wraps the first call if given (e.g. to collect a compiler's
    report); what it yields is kept in ``first_context``.
    """
    m = Measurement()
    out = None
    free_memory(device)  # start from an empty cache: earlier impls' blocks do not fragment this one
    try:
        synchronize(device)
        g0 = graphs_compiled()
        t0 = time.perf_counter()
        if on_first is not None:
            with on_first() as ctx:
                m.first_context = ctx
                out = run_once()
        else:
            out = run_once()
        synchronize(device)
        m.first_call_s = time.perf_counter() - t0
        m.graphs_compiled = graphs_compiled() - g0 if g0 >= 0 else None
        if check is not None:
            m.check = check(out)
        out = None
        m.extra_mib = extra_mib(run_once, device)
        m.timing = timing if device == "cuda" else "host clock"
        try:
            m.ms = bench_ms(run_once, device, warmup, rep, timing)
        except Exception as exc:  # noqa: BLE001 - capture refused: timed with events instead
            if timing != "cudagraph" or device != "cuda":
                raise
            synchronize(device)
            m.timing = f"events (CUDA graph capture failed: {short_error(exc)})"
            m.ms = bench_ms(run_once, device, warmup, rep)
    except Exception as exc:  # noqa: BLE001 - any failure is a result, recorded and reported
        m.status = short_error(exc)
        m.error = describe_error(exc)
        m.ms = None
    finally:
        out = None
        free_memory(device, collect=m.status != "ok")
    return m


# --------------------------------------------------------------------------------------------
# formatting and output
# --------------------------------------------------------------------------------------------

def fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "—"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    if x >= 0.01:
        return f"{x:.3f}"
    return f"{x:.2g}"


def fmt_num(x: Optional[float], digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def fmt_sig(x: Optional[float]) -> str:
    """Three significant digits, no exponent for ordinary magnitudes."""
    if x is None:
        return "—"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 0.01 or x == 0:
        return f"{x:.3g}"
    return f"{x:.2g}"


def fmt_ratio(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"


def fmt_err(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.1e}"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: Optional[str] = None) -> str:
    """A markdown table; ``align`` is one character per column (``l`` or ``r``)."""
    rows = [[str(c) for c in r] for r in rows]
    align = align or "l" * len(headers)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if a == "r" else c.ljust(w)
                                 for c, w, a in zip(cells, widths, align)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def write_outputs(md_path: Path, markdown: str, data: dict, copy_dir: Optional[str] = None) -> list[Path]:
    """Write ``markdown`` to ``md_path`` and ``data`` as JSON beside it (same stem); when the
    run is complete (``data["complete"]``, default true) also the plot ``<stem>.png``
    (:mod:`plot`, if matplotlib is installed), linked from the markdown; copy them all into
    ``copy_dir`` if given. Returns the paths written."""
    md_path = Path(md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    json_path = md_path.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    png = _plot(json_path) if data.get("complete", True) else None  # plotted once, at the end
    if png is not None:
        from plot import caption

        markdown += f"\n\n![{caption(json_path)}]({png.name})"
    md_path.write_text(markdown + "\n")
    written = [md_path, json_path] + ([png] if png is not None else [])
    if copy_dir:
        d = Path(copy_dir)
        d.mkdir(parents=True, exist_ok=True)
        for p in written[:]:
            if p.resolve() != (d / p.name).resolve():
                shutil.copyfile(p, d / p.name)
                written.append(d / p.name)
    return written


def _plot(json_path: Path) -> Optional[Path]:
    """The plot beside a results file (``benchmarks/plot.py``), or None: no per-N data, or no
    matplotlib (``pip install -e ".[bench]"``), or a plotting error (reported, never fatal)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    try:
        from plot import plot_results

        return plot_results(json_path)
    except Exception as exc:  # noqa: BLE001 - a plot must not lose a benchmark's tables
        print(f"plot of {json_path.name} failed: {exc!r}", file=sys.stderr)
        return None


def report(title: str, meta: dict, done: bool, notes: Sequence[str], legend: str, main: str,
           details: str, errors: str) -> tuple[str, str, str]:
    """Assemble a benchmark's report: (markdown for the results file, details and errors for
    stdout, the main table — printed last, since the device tool returns only the tail)."""
    status = "complete" if done else "partial (run in progress or cut short)"
    parts = [header_md(title, meta), f"- status: {status}", *notes, "", legend, "", main, "", "## Details", "", details]
    if errors:
        parts += ["", "## Errors", "", errors]
    stdout = "## Details\n\n" + details + (("\n\n## Errors\n\n" + errors) if errors else "")
    return "\n".join(parts), stdout, main


def first_call_cell(rec: dict) -> str:
    """A record's first-call seconds, with ``(+k)`` for the graphs Dynamo compiled during it."""
    cell = "—" if rec["first_call_s"] is None else f"{rec['first_call_s']:.2f}"
    if rec.get("graphs_compiled"):
        cell += f" (+{rec['graphs_compiled']})"
    return cell


def note_cell(rec: dict) -> str:
    """A record's note, led by its status when it did not run ("OOM", "err: ..."), and saying so
    when CUDA-graph timing was asked for but the calls could not be captured; table-safe."""
    note = rec["note"] or ""
    timing = rec.get("timing") or ""
    if "capture failed" in timing:  # asked for CUDA-graph timing, timed with events instead
        note = f"{note}; timed with {timing}" if note else f"timed with {timing}"
    if rec["status"] != "ok":
        note = rec["status"] + (f" ({note})" if note else "")
    return note.replace("|", "/").replace("\n", " ")


def error_lines(rows: Sequence) -> list[str]:
    """One markdown bullet per distinct failure (OOM excepted) in ``rows`` of
    ``(config with .label, {impl: record}, ...)``."""
    lines, seen = [], set()
    for cfg, recs, *_ in rows:
        for impl, r in recs.items():
            if r.get("error") and r["status"] != "OOM":
                key = (impl, r["error"][:200])
                if key in seen:
                    continue
                seen.add(key)
                lines.append(f"- {impl} at {cfg.label}: {r['error'][:600]}".replace("\n", " "))
    return lines


def to_json(args: Any, meta: dict, rows: Sequence, done: bool) -> dict:
    """The raw results: environment, arguments, and every configuration with its records."""
    a = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"meta": meta, "args": a, "complete": done, "configs": [{**s, "results": recs} for _, recs, s in rows]}


def parse_option(s: str) -> tuple[str, Any]:
    """``"key=value"`` from ``--fuser-option`` -> (key, value); on/off words become bools."""
    key, _, val = s.partition("=")
    low = val.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return key.strip(), True
    if low in ("0", "false", "no", "off"):
        return key.strip(), False
    return key.strip(), val


def fuser_collector():
    """A context-manager factory collecting fuser's report of what it compiled, or None."""
    try:
        from fuser.report import collecting

        return collecting
    except Exception:  # noqa: BLE001
        return None


def rel_err(got: tuple, ref: tuple) -> float:
    """Worst ‖a − b‖ / ‖b‖ (fp32) over the tensors; NaN if any is not finite."""
    import torch

    worst = 0.0
    for a, b in zip(got, ref):
        num = torch.linalg.vector_norm(a.float() - b.float()).item()
        den = torch.linalg.vector_norm(b.float()).item()
        e = num / max(den, 1e-30)
        if not math.isfinite(e):
            return float("nan")
        worst = max(worst, e)
    return worst


def fuser_outcome(report, pattern: Optional[str] = None) -> dict:
    """What fuser did with the graphs compiled during one call, from its report:
    ``{"note", "plan", "fused"}`` -- ``note`` is ``fused: <plans>`` or ``NOT fused (<why>)``,
    ``plan`` the plan name(s) (``"-"`` when nothing matched), ``fused`` a bool. Only matches of
    ``pattern`` count when it is given (others are named as ``also fused``). ``{}`` when no
    graph was compiled (a cached compile was reused: its earlier outcome stands)."""
    if report is None or not getattr(report, "graphs", 0):
        return {}
    try:
        def mine(x) -> bool:
            return pattern is None or x.pattern == pattern

        fused = [m for m in report.fused if mine(m)]
        others = sorted({m.pattern for m in report.fused if not mine(m)})
        extra = f"; also fused: {', '.join(others)}" if others else ""
        if fused:
            plans = ", ".join(sorted({m.plan.name if m.plan else "?" for m in fused}))
            return {"note": "fused: " + plans + extra, "plan": plans, "fused": True}
        unfused = [m for m in report.matches if mine(m)]
        if unfused:
            m = unfused[0]
            plan = m.plan.name if m.plan else "-"
            return {"note": f"NOT fused (planner: {plan}: {m.reason}){extra}", "plan": plan, "fused": False}
        rejected = [r for r in report.rejected if mine(r)]
        if rejected:
            return {"note": f"NOT fused (rejected: {rejected[0].reason}){extra}", "plan": "-", "fused": False}
        what = f"no {pattern} match; {report.graphs} graph(s)" if pattern else "no attention match"
        return {"note": f"NOT fused ({what}){extra}", "plan": "-", "fused": False}
    except Exception as exc:  # noqa: BLE001
        return {"note": f"(report unreadable: {exc})", "plan": "?", "fused": None}


def describe_fuser(report, pattern: Optional[str] = None) -> str:
    """``fused: <plan>`` / ``NOT fused: <reason>`` from a fuser report ("" if nothing compiled)."""
    return fuser_outcome(report, pattern).get("note", "")


# --------------------------------------------------------------------------------------------
# pieces the benchmark scripts share
# --------------------------------------------------------------------------------------------

def flex_available() -> Optional[str]:
    """``None`` if FlexAttention can be imported, else why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def runner(fn: Callable, inputs: Sequence, mode: str = "fwd", wrt: Sequence = (), grad_out=None,
           step: Optional[Callable[[], Any]] = None) -> Callable[[], tuple]:
    """The timed region of one implementation on one configuration, as a tuple of tensors:

    - ``fwd``: ``fn(*inputs)`` under ``torch.no_grad()`` (a tuple result is returned as is);
    - ``fwdbwd``: ``out = fn(*inputs)`` plus ``torch.autograd.grad(out, wrt, grad_out)``;
      returns ``(out.detach(), *grads)``.

    ``step`` runs before every call (e.g. ``torch.compiler.cudagraph_mark_step_begin``)."""
    import torch

    if mode == "fwd":
        def run_fwd():
            if step is not None:
                step()
            with torch.no_grad():
                out = fn(*inputs)
            return out if isinstance(out, tuple) else (out,)
        return run_fwd

    wrt = tuple(wrt)

    def run_fwdbwd():
        if step is not None:
            step()
        out = fn(*inputs)
        grads = torch.autograd.grad(out, wrt, grad_out)
        return (out.detach(), *grads)
    return run_fwdbwd


def ok_ms(records: dict, impl: str) -> Optional[float]:
    """The median ms of ``records[impl]`` if it ran, else None."""
    r = records.get(impl)
    return r["ms"] if r and r.get("status") == "ok" else None


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den`` when both are known (and ``den`` is not 0), else None."""
    return num / den if (num is not None and den) else None


def time_cell(rec: Optional[dict], wrong: bool = False, unfused: bool = False) -> str:
    """A time cell of a main table: median ms, or the status (``OOM``, ``err``, ``skip``);
    ``WRONG`` appended when the result is wrong, ``†`` when fuser's kernels did not run."""
    if rec is None:
        return "—"
    if rec["status"] != "ok":
        cell = rec["status"].split(":")[0]
        return cell + " WRONG" if wrong else cell
    cell = fmt_ms(rec["ms"])
    if wrong:
        cell += " WRONG"
    if unfused:
        cell += " †"
    return cell


def mask_label(causal: bool) -> str:
    """``causal`` or ``none``: the mask column of the tables."""
    return "causal" if causal else "none"


def visible_pairs(n: int, causal: bool) -> float:
    """(query, key) pairs a length-``n`` attention computes: N², or N(N+1)/2 when causal."""
    return n * (n + 1) / 2 if causal else float(n) * n


def floor_ms(amount: float, peak_per_s_e12: float) -> float:
    """Time in ms to do ``amount`` (FLOPs, bytes, exps) at ``peak_per_s_e12``·10¹² per second."""
    return amount / (peak_per_s_e12 * 1e12) * 1e3


def add_driver_args(p, *, budget_s: float, warmup: int = 25, rep: int = 100, out_name: str = "") -> None:
    """The options every driver script has: ``--warmup``/``--rep`` (do_bench ms; defaults applied
    by :func:`finish_driver_args`), ``--budget-s``, ``--out``, ``--out-dir`` (env
    ``FUSER_BENCH_OUT_DIR``), ``--fuser-option``, ``--device``, ``--seed``, ``--smoke``."""
    p.add_argument("--warmup", type=int, default=None, help=f"do_bench warm-up ms (default {warmup})")
    p.add_argument("--rep", type=int, default=None, help=f"do_bench repetition ms (default {rep})")
    p.add_argument("--budget-s", type=float, default=budget_s,
                   help="start no new measurement after this many seconds (0: no limit)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"markdown path (default benchmarks/results/{out_name}.md; {out_name}_smoke.md with --smoke)")
    p.add_argument("--out-dir", default=os.environ.get("FUSER_BENCH_OUT_DIR", ""),
                   help="also copy the .md and .json here (env FUSER_BENCH_OUT_DIR)")
    p.add_argument("--fuser-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option for torch.compile(backend='fuser', options=...), repeatable")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (fp32): an end-to-end check of the script, also on CPU (interpreter)")


def child_env(extra: Optional[dict] = None) -> dict:
    """The environment of a measuring child process (``--child``): this one's, plus ``extra``,
    with the repository root first on ``PYTHONPATH`` (the child imports fuser from this checkout)."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def child_outcome(returncode: int, stdout: str, stderr: str, tag: str) -> tuple[Optional[dict], dict]:
    """What a measuring child process left: ``(result, {})`` with the JSON of its last stdout line
    that starts with ``tag``, or ``(None, failure)`` — a nonzero exit or no such line — with the
    record fields ``status`` (``err: `` and its last unindented line of output) and ``error``
    (its exit code and last lines)."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(tag)), None)
    if returncode == 0 and line is not None:
        return json.loads(line[len(tag):]), {}
    tail = (stderr or stdout).strip().splitlines()[-12:]
    msg = next((ln for ln in reversed(tail) if ln.strip() and not ln.startswith(" ")), "no result")
    return None, {"status": "err: " + msg[:80], "error": f"exit {returncode}: " + " | ".join(tail)[-1500:]}


#: the sizes of the Hugging Face Llama the model benchmarks build from a config (no download)
LLAMA_SIZES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq")


def add_llama_args(p, full: dict, smoke: dict) -> None:
    """``--layers``, ``--hidden``, ``--intermediate``, ``--heads``, ``--kv-heads``, ``--vocab``,
    ``--seq`` (N) of the Llama a script builds (:func:`llama_config`); defaults ``full``, or
    ``smoke`` with ``--smoke``, filled in by :func:`finish_llama_args`."""
    for name in LLAMA_SIZES:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=("N " if name == "seq" else "") + f"(default {full[name]}; {smoke[name]} with --smoke)")


def finish_llama_args(a, full: dict, smoke: dict) -> None:
    """Fill in the sizes :func:`add_llama_args` left open (they depend on ``--smoke``)."""
    for name in LLAMA_SIZES:
        if getattr(a, name) is None:
            setattr(a, name, (smoke if a.smoke else full)[name])


def llama_config(sizes: dict, attn: str):
    """transformers' ``LlamaConfig`` of ``sizes`` (the :data:`LLAMA_SIZES` keys) with
    ``attn_implementation=attn`` (``"eager"``: the written-out softmax; ``"sdpa"``)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=max(sizes["seq"], 64), attn_implementation=attn)


def finish_driver_args(a, *, out_name: str, warmup: int = 25, rep: int = 100, smoke_warmup: int = 1,
                       smoke_rep: int = 5):
    """Fill in the defaults :func:`add_driver_args` left open (they depend on ``--smoke``)."""
    a.warmup = a.warmup if a.warmup is not None else (smoke_warmup if a.smoke else warmup)
    a.rep = a.rep if a.rep is not None else (smoke_rep if a.smoke else rep)
    a.out = a.out or RESULTS_DIR / (f"{out_name}_smoke.md" if a.smoke else f"{out_name}.md")
    a.fuser_options = dict(parse_option(s) for s in a.fuser_option)
    return a


# --------------------------------------------------------------------------------------------
# the driver
# --------------------------------------------------------------------------------------------

#: What a builder returns: the timed region, a reason to skip it here, or None (not run here).
Built = Union[Callable[[], Any], str, None]


@dataclasses.dataclass
class Impl:
    """One implementation for a group of configurations (built once per group, so a compiled
    function is reused across the group's configurations).

    ``build(run)`` gets the :class:`ConfigRun` of one configuration and returns the timed region
    ``run_once`` (no arguments; returns what the benchmark's ``check`` reads), a string (the
    reason it is skipped at this configuration: status ``skip``) or None (not run here: no
    record; to leave an implementation out of a configuration without building it, drop it in
    :meth:`Benchmark.implementations_at`). ``report``: collect fuser's report around its first call (a ``backend="fuser"``
    variant); what :meth:`Benchmark.describe` makes of it is kept in ``info`` and carried to the
    group's later configurations (a reused compile reports nothing). ``info`` goes into every
    record of this implementation (e.g. ``note``, ``plan``). ``timing``: how it is timed on CUDA
    (:data:`TIMINGS`)."""

    build: Callable[["ConfigRun"], Built]
    report: bool = False
    info: dict = dataclasses.field(default_factory=dict)
    timing: str = "events"  # :data:`TIMINGS`; the record's ``timing`` says what was used


@dataclasses.dataclass
class ConfigRun:
    """The configuration being measured, as the hooks see it: ``inputs`` (from
    :meth:`Benchmark.inputs`), ``ref`` (from :meth:`Benchmark.reference`, which a check may also
    set), ``impl`` (the implementation being checked), ``extra`` (anything the script keeps)."""

    cfg: Any
    inputs: Any = None
    ref: Any = None
    impl: str = ""
    extra: dict = dataclasses.field(default_factory=dict)


class Benchmark:
    """The driver: subclass it, fill in the hooks, call :meth:`main`.

    Hooks (``self.args`` is the parsed command line, ``self.device``/``self.dtype`` are set
    before any hook that measures is called):

    - :meth:`groups` -> ``[(group, [config, ...]), ...]``; a config has a ``label``.
    - :meth:`implementations` (group) -> ``{name: Impl}`` in run order;
      :meth:`implementations_at` (run, impls) -> the ones for one configuration (default: all;
      ``run.inputs`` is None when nothing will be measured there: budget spent).
    - :meth:`inputs` (config) -> the inputs (``torch.manual_seed`` is set before, per config).
    - :meth:`reference` (run) -> what the checks compare with (or None); timed (``state["ref_s"]``),
      a failure is recorded (every record's note, the errors section) and the run goes on.
    - :meth:`check` (run, out) -> an error measure; :meth:`store_check` puts it in the record.
    - :meth:`describe` (fuser report) -> record fields (``note``, ``plan``, ``fused``).
    - :meth:`summarize` (config, records) -> the configuration's derived numbers (JSON).
    - :meth:`main_table`, :meth:`details_table`, :meth:`legend`, :meth:`notes`, :meth:`wrong`,
      or all of the markdown at once with :meth:`render`.
    """

    title = "fuser benchmark"
    #: Short name for the banner line (``<name> benchmark on <device>: ...``).
    name = "fuser"
    #: Width of the configuration label in the progress lines.
    label_width = 32
    #: Label of the reference in notes and errors.
    reference_label = "reference"
    #: Whether any implementation needs ``import fuser`` (registers ``backend="fuser"``).
    needs_fuser = True

    def __init__(self, args) -> None:
        self.args = args
        self.rows: list[tuple[Any, dict, dict]] = []
        self.state: dict[str, Any] = {}
        self.device = "cpu"
        self.dtype = None
        self.meta: dict = {}

    # -- hooks ---------------------------------------------------------------------------
    def groups(self) -> Iterable[tuple[Any, list]]:
        raise NotImplementedError

    def implementations(self, group) -> dict[str, Impl]:
        raise NotImplementedError

    def implementations_at(self, run: ConfigRun, impls: dict[str, Impl]) -> dict[str, Impl]:
        return impls

    def inputs(self, cfg) -> Any:
        raise NotImplementedError

    def reference(self, run: ConfigRun) -> Any:
        return None

    def check(self, run: ConfigRun, out) -> Any:
        return None if run.ref is None else rel_err(out, run.ref)

    def new_record(self, impl: str, run: ConfigRun) -> dict:
        return {"impl": impl, "status": "ok", "ms": None, "extra_mib": None, "first_call_s": None,
                "graphs_compiled": None, "rel_err": None, "note": "", "error": None, "timing": None}

    def store_check(self, rec: dict, value) -> None:
        rec["rel_err"] = value

    def describe(self, report) -> dict:
        return fuser_outcome(report)

    def summarize(self, cfg, records: dict) -> dict:
        return {}

    def banner(self) -> str:
        return ""

    def legend(self) -> str:
        return ""

    def main_table(self) -> str:
        return ""

    def details_table(self) -> str:
        return ""

    def notes(self) -> list[str]:
        """Markdown bullets under the header: budget spent, context broken, reference time."""
        notes = []
        if self.state.get("budget_hit"):
            notes.append(f"- time budget of {self.args.budget_s:.0f} s was spent; later measurements were skipped")
        if self.state.get("broken"):
            notes.append("- a CUDA error broke the context; later measurements were skipped")
        if self.state.get("aborted"):
            notes.append(f"- the run stopped early: {self.state['aborted']}")
        return notes

    def errors(self) -> str:
        lines = error_lines(self.rows)
        for e in self.state.get("ref_errors", []):
            lines.append(f"- {self.reference_label} at {e[:600]}".replace("\n", " "))
        return "\n".join(lines)

    def wrong(self) -> list[str]:
        """Labels of the configurations where a subject's result is wrong (exit status 1)."""
        return []

    def final_lines(self) -> list[str]:
        """Lines printed after the tables (before the main table is printed again)."""
        lines = []
        if self.state.get("budget_hit"):
            lines.append(f"NOTE: time budget of {self.args.budget_s:.0f} s was spent; later measurements were skipped.")
        if self.state.get("broken"):
            lines.append("NOTE: a CUDA error broke the context; later measurements were skipped.")
        return lines

    def render(self, done: bool) -> tuple[str, str, str]:
        """(markdown for the results file, details + errors for stdout, the main table)."""
        return report(self.title, self.meta, done, self.notes(), self.legend(), self.main_table(),
                      self.details_table(), self.errors())

    def to_json(self, done: bool) -> dict:
        return to_json(self.args, self.meta, self.rows, done)

    # -- the run -------------------------------------------------------------------------
    def budget_spent(self) -> bool:
        spent = bool(self.args.budget_s) and elapsed_s() > self.args.budget_s
        if spent:
            self.state["budget_hit"] = True
        return spent

    def skip_reason(self) -> Optional[str]:
        """Why no new measurement starts now (context broken, budget spent), or None."""
        if self.state.get("broken"):
            return "CUDA context broken by an earlier error"
        if self.budget_spent():
            return f"time budget ({self.args.budget_s:.0f} s) spent"
        return None

    def setup(self) -> Optional[int]:
        """Environment, device, dtype, header; an exit status if the run cannot start."""
        a = self.args
        setup_environment(force_cpu=a.device == "cpu")
        import torch

        self.device = "cuda" if (a.device != "cpu" and torch.cuda.is_available()) else "cpu"
        if a.device == "cuda" and self.device != "cuda":
            print("--device cuda: no CUDA device found", file=sys.stderr)
            return 2
        if self.needs_fuser:
            import fuser  # noqa: F401 - registers backend="fuser"
        import warnings

        warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")
        if getattr(a, "shapes", None) == "static":
            raise_recompile_limit(64)
        if getattr(a, "dtype", None) in DTYPES:
            self.dtype = getattr(torch, DTYPES[a.dtype])
        self.meta = env_header(self.device)
        line = self.banner()
        if line:
            print(line, flush=True)
        if self.device == "cpu":
            print("No GPU: CPU timing with a host clock; fuser's kernels run in Triton's interpreter. "
                  "Numbers are for checking the script, not for reading.", flush=True)
        return None

    def write(self, done: bool) -> list[Path]:
        md, _, _ = self.render(done)
        return write_outputs(self.args.out, md, self.to_json(done), self.args.out_dir or None)

    def main(self) -> int:
        """Measure the grid, write the results after every configuration, print the tables."""
        status = self.setup()
        if status is not None:
            return status
        import torch

        seed = self.args.seed
        try:
            for group, configs in self.groups():
                impls = self.implementations(group)
                for cfg in configs:
                    seed += 1
                    torch.manual_seed(seed)
                    recs = self.run_config(cfg, impls)
                    self.rows.append((cfg, recs, self.summarize(cfg, recs)))
                    self.write(done=False)
                del impls
                free_memory(self.device, collect=True)
        except BaseException as exc:  # keep what was measured, then stop as asked
            self.state["aborted"] = describe_error(exc, 300)
            self.write(done=False)
            raise
        md, stdout, main_tbl = self.render(done=True)
        written = self.write(done=True)
        wrong = self.wrong()
        print("\n" + stdout + "\n")
        print("wrote " + ", ".join(str(p) for p in written))
        for line in self.final_lines():
            print(line)
        print(f"total {elapsed_s():.0f} s\n")
        print(f"## {self.title} — {self.meta['device']}, torch {self.meta['torch']}, "
              f"triton {self.meta['triton']}, CUDA {self.meta['cuda']}\n\n{self.legend()}\n")
        print(main_tbl, flush=True)
        return 1 if wrong else 0

    def run_config(self, cfg, impls: dict[str, Impl]) -> dict[str, dict]:
        """Measure every implementation on one configuration; returns name -> record."""
        run = ConfigRun(cfg)
        records: dict[str, dict] = {}
        why = self.skip_reason()
        if why is None:
            run.inputs = self.inputs(cfg)
        here = self.implementations_at(run, impls)
        ref_note = ""
        if why is None:
            try:
                synchronize(self.device)
                t0 = elapsed_s()
                run.ref = self.reference(run)
                synchronize(self.device)
                self.state["ref_s"] = self.state.get("ref_s", 0.0) + elapsed_s() - t0
            except Exception as exc:  # noqa: BLE001
                ref_note = f"{self.reference_label} failed: {short_error(exc)}"
                self.state.setdefault("ref_errors", []).append(f"{cfg.label}: {describe_error(exc)}")
                run.ref = None
                free_memory(self.device, collect=True)
        for name, impl in here.items():
            rec = self.measure_impl(run, name, impl)
            if rec is None:
                continue
            if ref_note:
                rec["note"] = (rec["note"] + "; " if rec["note"] else "") + ref_note
            records[name] = rec
        run.inputs = run.ref = None
        run.extra.clear()
        free_memory(self.device)
        return records

    def measure_impl(self, run: ConfigRun, name: str, impl: Impl) -> Optional[dict]:
        """One record: skipped (context broken, budget spent, builder's reason), failed, or
        measured with :func:`measure` (first call, check, memory, do_bench)."""
        rec = {**self.new_record(name, run), **impl.info}
        why = self.skip_reason()
        if why is not None:
            rec.update(status="skip", note=why)
            return rec
        try:
            run_once = impl.build(run)
        except Exception as exc:  # noqa: BLE001 - e.g. a compile or a block mask failing
            rec.update(status=short_error(exc), error=describe_error(exc))
            free_memory(self.device, collect=True)
            self.progress(run, name, rec)
            return rec
        if run_once is None:
            return None
        if isinstance(run_once, str):
            rec.update(status="skip", note=run_once)
            return rec
        run.impl = name
        a = self.args
        m = measure(run_once, self.device, a.warmup, a.rep, check=lambda out: self.check(run, out),
                    on_first=fuser_collector() if impl.report else None, timing=impl.timing)
        if impl.report and m.first_context is not None:
            found = self.describe(m.first_context)
            if found.get("note"):  # compiled during this call; else the group's earlier compile stands
                impl.info.update(found)
                rec.update(found)
        rec.update(status=m.status, ms=m.ms, extra_mib=m.extra_mib, first_call_s=m.first_call_s,
                   graphs_compiled=m.graphs_compiled, error=m.error, timing=m.timing)
        self.store_check(rec, m.check)
        if m.error and context_broken(m.error):
            self.state["broken"] = True
        self.progress(run, name, rec)
        return rec

    def progress(self, run: ConfigRun, name: str, rec: dict) -> None:
        """One line per measurement while the run goes (stdout)."""
        res = fmt_ms(rec["ms"]) + " ms" if rec["status"] == "ok" else rec["status"]
        err = rec.get("rel_err")
        print(f"  {run.cfg.label:<{self.label_width}} {name:<9} {res:>12}  first call {rec['first_call_s'] or 0:7.2f} s"
              + (f"  err {fmt_err(err)}" if err is not None else "") + f"  {rec['note'] or ''}", flush=True)
