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
from typing import Any, Callable, Iterable, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
START_TIME = time.perf_counter()


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


def bench_ms(fn: Callable[[], Any], device: str, warmup: int, rep: int) -> float:
    """Median time of ``fn()`` in ms: ``triton.testing.do_bench`` on CUDA (events, L2 flushed
    before each run); on CPU, a host clock around each call (for smoke runs only)."""
    if device == "cuda":
        import triton.testing

        synchronize(device)
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

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def measure(run_once: Callable[[], Any], device: str, warmup: int, rep: int,
            check: Optional[Callable[[Any], Any]] = None,
            on_first: Optional[Callable[[], Any]] = None) -> Measurement:
    """Measure one implementation on one configuration.

    ``run_once()`` does the whole timed region (e.g. forward, or forward + backward) and
    returns what ``check`` should look at. Steps: synchronize; first call, timed with a host
    clock (includes compilation: this is the "first call s" users feel) and checked; one
    memory-probe call; then ``do_bench`` (median). ``on_first``, a context-manager factory,
    wraps the first call if given (e.g. to collect a compiler's report); what it yields is
    kept in ``first_context``.
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
        markdown += f"\n\n![median ms against N]({png.name})"
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
    """A record's note, led by its status when it did not run ("OOM", "err: ..."); table-safe."""
    note = rec["note"] or ""
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


def describe_fuser(report) -> str:
    """``fused: <plan>`` / ``NOT fused: <reason>`` from a fuser report."""
    if report is None:
        return ""
    try:
        if report.fused:
            plans = sorted({m.plan.name if m.plan else "?" for m in report.fused})
            return "fused: " + ", ".join(plans)
        if report.matches:
            m = report.matches[0]
            return f"NOT fused (planner: {m.plan.name if m.plan else '-'}: {m.reason})"
        if report.rejected:
            return f"NOT fused (rejected: {report.rejected[0].reason})"
        return "NOT fused (no attention match)" if report.graphs else ""
    except Exception as exc:  # noqa: BLE001
        return f"(report unreadable: {exc})"
