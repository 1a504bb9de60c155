"""Launch helpers shared by every kernel family: modes, sizes, dtypes and device kinds,
precision, outputs, autotuning, config fitting.

Nothing here knows a pattern's math or vocabulary; kernel families (``codegen/attention.py``,
...) build on it, and the attention-like families share their variant vocabulary (causal
modes, mask kinds, fills) in ``codegen/variants.py``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from .render import RenderedKernel, cache_dir, load_module

log = logging.getLogger("fuser")

_poison = threading.local()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def interpreted(device: torch.device | str) -> bool:
    """True when kernels for tensors on ``device`` run in Triton's interpreter (CPU tensors)."""
    return torch.device(device).type == "cpu"


_interp_lock = threading.RLock()
_interp_fns: dict[int, Any] = {}


def _triton_language_modules() -> list:
    import triton.language as tl

    mods = [tl]
    for name in ("standard", "math", "core", "random"):
        m = getattr(tl, name, None)
        if m is not None:
            mods.append(m)
    return mods


def _language_objects() -> list:
    """The objects Triton's interpreter patches: the language modules, their tensor classes, and
    the classes whose methods it replaces (``dtype.to_ir``, which asks the builder for unsigned
    types the compiler's builder lacks: left patched, a kernel with a bool or uint8 argument no
    longer compiles, ``'builder' object has no attribute 'get_uint8_ty'``; ``condition``)."""
    import triton.language as tl

    objs = [tl, tl.core, tl.core.tensor, getattr(tl, "math", None), getattr(tl.core, "tensor_descriptor_base", None),
            getattr(tl.core, "dtype", None), getattr(tl.core, "condition", None)]
    return [o for o in dict.fromkeys(objs) if o is not None]


@contextlib.contextmanager
def _language_restored() -> Iterator[None]:
    """Put every attribute of :func:`_language_objects` back as it was on entry."""
    saved = [(obj, dict(vars(obj))) for obj in _language_objects()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            for name in [n for n in now if n not in before]:
                try:
                    delattr(obj, name)
                except (AttributeError, TypeError):
                    pass
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    try:
                        setattr(obj, name, value)
                    except (AttributeError, TypeError):
                        pass


_MISSING = object()


def _patch_index_for_numpy(interpreter) -> Callable | None:
    """Triton's interpreter (3.6 and before) reads a scalar kernel argument used as an index —
    ``range(lo, hi)`` with ``hi`` an argument — as ``int(handle.data)``, a one-element NumPy
    array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"; triton-lang/triton issue 9171, fixed upstream by squeezing first). Wrap the
    interpreter's tensor patching so ``__index__`` squeezes first (what the fix does; a no-op
    where Triton already does it). Returns the original function to restore, or None when this
    Triton has no such function (nothing patched)."""
    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fuser_squeezes_index", False):
        return None

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        out = orig(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        return out

    patch_lang_tensor._fuser_squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return orig


@contextlib.contextmanager
def interpreter_mode() -> Iterator[None]:
    """Run Triton's interpreter correctly whatever the import order.

    Triton decides at *its own import* whether its standard library (``tl.sum``, ``tl.max``,
    ``tl.cdiv``, ... — themselves ``@triton.jit`` functions) is compiled or interpreted, from
    ``TRITON_INTERPRET``. ``import torch._dynamo`` imports Triton, so by the time a backend
    runs, the standard library is usually in compiled mode, and an interpreted kernel calling
    ``tl.sum`` fails ("Cannot call @triton.jit'd outside of the scope of a kernel"). Inside
    this context the compiled-mode standard-library functions are swapped for interpreted
    ones (the interpreter's fast NumPy paths compare against these very objects, so they
    still apply), and ``TRITON_INTERPRET=1`` is set; both are restored on exit, so GPU
    kernels compiled in the same process are unaffected. Re-entrant and thread-safe.

    The interpreter patches the language (``tl.core.tensor``'s methods, the builtins) for each
    interpreted call, and a call of a jitted helper from inside a kernel (Triton 3.9's
    ``InterpretedFunction.__call__``) never undoes its patch: afterwards Triton can no longer
    compile a kernel in this process (``'value' object has no attribute 'dtype'`` — the GPU
    path, and Inductor's analysis of the kernels it launches). So the language objects are
    snapshotted on entry and restored on exit.

    Triton 3.6's interpreter with NumPy 2.4 fails every kernel whose loop bound is a scalar
    argument (:func:`_patch_index_for_numpy`: patched here, restored on exit).
    """
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with _interp_lock, _language_restored():
        old_env = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        patched_index = _patch_index_for_numpy(interpreter)
        swapped = []
        for mod in _triton_language_modules():
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, JITFunction):
                    repl = _interp_fns.get(id(obj))
                    if repl is None:
                        repl = _interp_fns[id(obj)] = InterpretedFunction(obj.fn)
                    setattr(mod, name, repl)
                    swapped.append((mod, name, obj))
        try:
            yield
        finally:
            for mod, name, obj in reversed(swapped):
                setattr(mod, name, obj)
            if patched_index is not None:
                interpreter._patch_lang_tensor = patched_index
            if old_env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old_env


def kernel_module(kernel: RenderedKernel, interpret: bool):
    """Import ``kernel`` for the interpreter or for the GPU.

    ``@triton.jit`` chooses interpreted or compiled execution when the module is imported,
    from ``TRITON_INTERPRET``. Interpreted and compiled kernels are rendered with a distinct
    ``interpret`` template parameter (so they are distinct files and modules), and the variable
    is set to match around the import only.
    """
    want = "1" if interpret else "0"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = want
    try:
        return load_module(kernel)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


@functools.lru_cache(maxsize=None)
def device_properties(index: int) -> dict[str, Any]:
    """Name, SM count and capability of CUDA device ``index``."""
    p = torch.cuda.get_device_properties(index)
    return {
        "name": p.name,
        "sm_count": p.multi_processor_count,
        "capability": (p.major, p.minor),
    }


def sm_count(device: torch.device | str) -> int:
    """Number of streaming multiprocessors (a nominal 132 for the interpreter, an H100)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 132
    return device_properties(device.index if device.index is not None else torch.cuda.current_device())["sm_count"]


def gpu_name(device: torch.device | str) -> str:
    """A short name of the device kind: the CUDA device name, or ``"interpreter"``."""
    device = torch.device(device)
    if device.type != "cuda":
        return "interpreter"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return device_properties(idx)["name"]


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot`` on operands of ``dtype``.

    fp32 operands follow ``torch.get_float32_matmul_precision()``: ``"highest"`` (torch's
    default) gives ``"ieee"``, ``"high"``/``"medium"`` give ``"tf32"``, exactly where torch's
    own matmuls would use TF32. 16-bit operands always use ``"ieee"`` (the argument is then moot).
    """
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


@contextlib.contextmanager
def _set_in_thread(holder: threading.local, name: str, value: Any, default: Any = None) -> Iterator[None]:
    """Within: ``holder.name`` is ``value`` on this thread; its previous value (``default``
    when unset) is restored on exit. The contexts below are such settings."""
    old = getattr(holder, name, default)
    setattr(holder, name, value)
    try:
        yield
    finally:
        setattr(holder, name, old)


def poison_outputs(value: float = float("nan")):
    """Within this context, :func:`empty` fills new outputs with ``value`` (tests use NaN),
    so any element a kernel fails to write shows up in the result."""
    return _set_in_thread(_poison, "value", value)


_POISON_ENV = os.environ.get("FUSER_POISON_OUTPUTS", "0") == "1"  # read once: empty() is on the hot path


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty``, poisoned (NaN) inside :func:`poison_outputs`, or in every call when
    ``FUSER_POISON_OUTPUTS=1`` was set when fuser was imported."""
    return _poisoned(torch.empty(shape, dtype=dtype, device=device))


def empty_like(x: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(x)`` (``x``'s shape, dtype, device and, for a dense ``x``, strides),
    poisoned as :func:`empty` is."""
    return _poisoned(torch.empty_like(x))


def _poisoned(out: torch.Tensor) -> torch.Tensor:
    """``out`` filled with the poison value when one is in force (:func:`empty`), else as is."""
    value = getattr(_poison, "value", None)
    if value is None and _POISON_ENV:
        value = float("nan")
    if value is not None and out.numel():
        out.fill_(value)
    return out


# --------------------------------------------------------------------------------------------
# Autotuning: time candidate configs on the device once per key, cache the winner on disk.
# --------------------------------------------------------------------------------------------

_tune_lock = threading.Lock()
_tune_mem: dict[str, dict] = {}


def _tune_file() -> Path:
    return cache_dir().parent / "autotune.json"


def _json_record(path: Path) -> dict:
    """The JSON object kept in ``path`` (fuser's on-disk records: autotuning winners, shared
    memory of compiled kernels); ``{}`` when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _json_record_put(path: Path, key: str, value: Any) -> None:
    """``path``'s record with ``key: value`` added: read, merged and replaced whole through a
    temporary file of this process (callers hold their lock; a concurrent process's entry may be
    lost, and is then computed again). Raises OSError when the cache cannot be written."""
    disk = _json_record(path)
    disk[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(disk, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _stand_in(x: Any) -> Any:
    """A real tensor with ``x``'s sizes, strides, dtype and device (``x`` fake or functional),
    filled with standard normal values (floats) or random bits (bool, integers)."""
    if not isinstance(x, torch.Tensor):
        return x
    size, stride = [int(d) for d in x.shape], [int(d) for d in x.stride()]
    numel = 1 + sum((d - 1) * st for d, st in zip(size, stride)) if all(size) else 0
    if x.dtype.is_floating_point:
        flat = torch.randn(numel, dtype=x.dtype, device=x.device)
    else:
        flat = torch.randint(0, 2, (numel,), device=x.device).to(x.dtype)
    return flat.as_strided(size, stride)


def autotune(key: str, candidates: Sequence[dict], run: Callable[..., Any],
             timer: Callable[[Callable[[], Any]], float] | None = None,
             inputs: Sequence[Any] | None = None) -> dict:
    """Return the fastest of ``candidates`` for ``key``, timing them on first use.

    Args:
        key: identifies the problem: kernel family, shapes, dtypes, GPU name.
        candidates: configs (plain JSON-able dicts); the first is the default.
        run: launches the kernel(s) with one config, ``run(config)``, or ``run(config, *inputs)``
            when ``inputs`` are given; must not change its inputs.
        timer: milliseconds of one call of a function; default ``triton.testing.do_bench``
            (GPU; median of 20 ms of runs). Interpreted kernels pass :func:`wall_clock_ms`.
        inputs: the tensors (or None) ``run`` reads. While the op is traced (:func:`tracing`:
            fake tensors, nothing can run) the candidates are timed on real stand-ins of the
            same sizes, strides, dtypes and device, random values (:func:`_stand_in`), outside
            the tracer: autotuning under ``torch.compile`` happens at compile time, as
            Inductor's own. Without ``inputs`` a traced call takes the cached winner or the
            first candidate, unremembered.

    Returns:
        The winning config. Winners are kept in memory and in ``<cache>/autotune.json``, so
        later processes skip the timing. A candidate that fails to compile or run (e.g. out
        of shared memory) is skipped; if all fail, the first is returned.
    """
    with _tune_lock:
        if key in _tune_mem:
            return _tune_mem[key]
        disk = _json_record(_tune_file())
        if key in disk:
            _tune_mem[key] = disk[key]
            return disk[key]
    if tracing():
        first = _first_tensor(inputs or (), {})
        if first is None or first.device.type != "cuda":
            log.info("fuser: autotune %s: traced, nothing to time; the default config %s", key, candidates[0])
            return candidates[0]
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # outside the tracer: real tensors, real launches
            real = [_stand_in(x) for x in inputs]
            return autotune(key, candidates, run, timer, real)
    if inputs is not None:
        run_one = run
        run = lambda cfg: run_one(cfg, *inputs)  # noqa: E731
    if timer is None:
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")

    best, best_ms = _time_configs(key, candidates, run, timer)
    with _tune_lock:
        _tune_mem[key] = best
        _json_record_put(_tune_file(), key, best)
    return best


#: While autotuning, a progress line at INFO at most this often (seconds), as Inductor's
#: max-autotune reports its own; each config's time is at DEBUG.
AUTOTUNE_PROGRESS_S = 5.0
#: How many of the fastest configs :func:`autotune`'s closing INFO line lists.
AUTOTUNE_SHOW = 5


def _time_configs(key: str, candidates: Sequence[dict], run: Callable[[dict], Any],
                  timer: Callable[[Callable[[], Any]], float]) -> tuple[dict, float]:
    """Time every candidate; ``(fastest, its ms)`` (the first candidate and ``inf`` if none
    ran). Logs through the ``fuser`` logger at INFO what is tuned and how many configs, a
    progress line every :data:`AUTOTUNE_PROGRESS_S` seconds, and at the end the winner, its
    time, the runners-up (relative to it) and the time taken; each config at DEBUG."""
    import time

    n = len(candidates)
    log.info("fuser: autotuning %s: timing %d configs (once: the winner is cached in %s)", key, n, _tune_file())
    t0 = last = time.perf_counter()
    timed: list[tuple[float, int]] = []
    failed = 0
    for i, cfg in enumerate(candidates):
        try:
            ms = timer(lambda: run(cfg))
        except Exception as exc:  # a config that cannot run here is simply not a candidate
            failed += 1
            log.debug("fuser: autotune %s: config %s failed: %s", key, cfg, exc)
        else:
            timed.append((ms, i))
            log.debug("fuser: autotune %s: %s -> %.4f ms", key, cfg, ms)
        now = time.perf_counter()
        if i + 1 < n and now - last >= AUTOTUNE_PROGRESS_S:
            last = now
            best_so_far = f"{min(timed)[0]:.4f} ms" if timed else "none ran yet"
            log.info("fuser: autotuning %s: %d/%d configs timed in %.1f s, best so far %s",
                     key, i + 1, n, now - t0, best_so_far)
    took = time.perf_counter() - t0
    if not timed:
        log.info("fuser: autotune %s: none of the %d configs ran here (%.1f s); taking the first, %s",
                 key, n, took, candidates[0])
        return candidates[0], float("inf")
    timed.sort()
    best_ms, best_i = timed[0]
    ranking = "; ".join(f"{candidates[i]} {ms:.4f} ms ({100 * best_ms / ms:.0f}%)" if ms > 0 else
                        f"{candidates[i]} {ms:.4f} ms" for ms, i in timed[:AUTOTUNE_SHOW])
    log.info("fuser: autotune %s -> %s (%.4f ms); %d configs timed%s in %.1f s; fastest: %s",
             key, candidates[best_i], best_ms, len(timed), f", {failed} failed" if failed else "", took, ranking)
    return candidates[best_i], best_ms


def wall_clock_ms(fn: Callable[[], Any], repeats: int = 3) -> float:
    """The median wall-clock milliseconds of ``repeats`` calls of ``fn`` after one warm-up call
    (for :func:`autotune` where no GPU timer applies: kernels in Triton's interpreter)."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


#: The input dtypes fuser's kernels take (one dtype for all tensor inputs of a call).
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def device_kind(device: torch.device | str) -> str:
    """``"interpreter"`` (CPU tensors), ``"sm90"`` (Hopper) or ``"cuda"`` (any other CUDA GPU):
    the key of the kernel families' config tables."""
    device = torch.device(device)
    if interpreted(device):
        return "interpreter"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, _ = device_properties(index)["capability"]
    return "sm90" if major == 9 else "cuda"


def check_config(cfg: dict) -> dict:
    """Raise ``ValueError`` unless every block size in ``cfg`` is a power of two >= 16."""
    for key, value in cfg.items():
        if key.startswith("BLOCK") or key == "PRE_BLOCK_M":
            if value < 16 or value & (value - 1):
                raise ValueError(f"{key} must be a power of two >= 16, got {value}")
    return cfg


# --------------------------------------------------------------------------------------------
# Config fitting: does a config's kernel fit the device's shared memory? Decided by compiling
# the launch (not running it), before it is made or recorded for Inductor.
# --------------------------------------------------------------------------------------------


class ConfigDoesNotFit(RuntimeError):
    """No offered config of a launch fits the device's shared memory (:func:`launch_first_fitting`).

    Attributes: ``key`` (the launch's key), ``needs`` (one ``(config, kernel name, bytes needed)``
    per config, the first kernel of that config that does not fit), ``limit`` (bytes per block
    on the device), ``device``.
    """

    def __init__(self, key, needs: list[tuple[dict, str, int]], limit: int, device) -> None:
        self.key, self.needs, self.limit, self.device = key, needs, limit, device
        explicit = len(needs) == 1
        rows = "; ".join(f"{cfg}: kernel {name} needs {need} bytes" for cfg, name, need in needs)
        super().__init__(
            f"fuser: {'the given config does' if explicit else f'none of the {len(needs)} configs does'} not fit "
            f"in the shared memory of {device} ({limit} bytes per block, CUDA's opt-in maximum): {rows}. "
            f"Give a config with smaller BLOCK sizes or fewer num_stages (launch key {key}).")


def shared_memory_limit(device: torch.device | str) -> int | None:
    """Bytes of shared memory one program (thread block) may use on ``device``, or None where
    nothing is checked (CPU tensors: Triton's interpreter; ``meta``).

    CUDA: the opt-in per-block maximum (``cudaDevAttrMaxSharedMemoryPerBlockOptin``, torch's
    ``get_device_properties(i).shared_memory_per_block_optin``; Triton's launcher compares a
    kernel against the same attribute, its driver's ``max_shared_mem``, and raises
    ``OutOfResources`` above it): 232448 bytes (227 KiB) on an H100.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_shared_limit(index)


@functools.lru_cache(maxsize=None)
def _cuda_shared_limit(index: int) -> int:
    limit = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    if limit:
        return int(limit)
    # an older torch: ask Triton's driver (the launcher's own limit)
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def compile_target(device: torch.device | str):
    """Triton's ``GPUTarget`` for CUDA ``device``: ``("cuda", 10 * major + minor, 32)`` (90 on an
    H100), as Triton's CUDA driver reports the current device."""
    from triton.backends.compiler import GPUTarget

    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = device_properties(index)["capability"]
    return GPUTarget("cuda", 10 * major + minor, 32)


def _mock_args(values):
    """Tensors (real, fake or functional) replaced by Triton's ``MockTensor`` of their dtype: a
    pointer of that element type, 16-byte aligned (as Inductor assumes of its buffers)."""
    from triton.runtime.jit import MockTensor

    return [MockTensor(v.dtype) if isinstance(v, torch.Tensor) else v for v in values]


_binders: dict[tuple, tuple] = {}
#: per compile key: the bytes of shared memory, or a Future of them while a compile runs
_shared_needs: dict[tuple, Any] = {}
_shared_lock = threading.Lock()
_pool: Any = None
#: threads that compile kernels for :func:`compiled_shared_memory` (Triton releases the GIL while
#: it compiles: two compiles on two cores take about the time of one); ``FUSER_COMPILE_THREADS``
#: (read at import) sets it, and 0 compiles on the calling thread and prefetches nothing
#: (:func:`prefetch_compiles`), as before the pool existed
COMPILE_THREADS = int(os.environ.get("FUSER_COMPILE_THREADS", "") or max(1, min(8, os.cpu_count() or 1)))
#: whether the backend traces a graph's fused calls before Inductor compiles it, to start their
#: kernels' compiles together (:func:`prefetch_compiles`; ``fuser.backend.prefetch_kernel_compiles``).
#: ``FUSER_PREFETCH=1`` (read at import) turns it on; off by default: on an H200 (torch 2.11,
#: Triton 3.6) a 4-layer Llama training step's first call took 35.5 s cold with it, 32.1 s without
#: (the trace itself took 4.6 s of the main thread) and 6.9 s warm against Inductor's 3.9 (a warm FX-graph cache
#: needs none of the compiles it starts; benchmarks/results/compile_time_prefetch.md, compile_time_serial.md)
PREFETCH = os.environ.get("FUSER_PREFETCH", "").strip().lower() in ("1", "true", "on")

def _compile_pool():
    global _pool
    with _shared_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="fuser-compile")
        return _pool


_shared_file_lock = threading.Lock()
#: Held while Triton's front end parses a kernel's source (``ast.parse`` inside ``make_ir`` and
#: ``JITFunction.cache_key``): CPython 3.11's ``ast`` object construction is not safe in two
#: threads at once (``SystemError: AST constructor recursion depth mismatch``, seen in CI when
#: the prefetch started several compiles together). Triton's passes after it run in parallel.
#: Inductor's own parsing of a kernel on the main thread does not take it; a compile that fails
#: that way is retried once by the full compile (:func:`_compile_shared`).
_frontend_lock = threading.Lock()


def _invalidating_env() -> str:
    """Triton's environment variables that change what it compiles (``TRITON_*`` debug and
    pass switches; Triton keys its own cache on them), as text for ``shared_memory.json``'s key;
    empty where this Triton does not list them."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
    except ImportError:
        try:
            from triton.runtime.cache import get_cache_invalidating_env_vars  # older Triton
        except ImportError:
            return ""
    return repr(sorted(get_cache_invalidating_env_vars().items()))


def _shared_file() -> Path:
    return cache_dir().parent / "shared_memory.json"


def _shared_store(key: str, need: int) -> None:
    """Adds ``key: need`` to ``<cache>/shared_memory.json`` (an unwritable cache costs a compile
    in the next process, nothing else)."""
    try:
        with _shared_file_lock:
            _json_record_put(_shared_file(), key, int(need))
    except OSError as exc:
        log.debug("fuser: shared-memory cache not written (%s)", exc)


#: The compile stage after which Triton's NVIDIA and AMD backends have set ``metadata["shared"]``
#: (shared memory is allocated while lowering to LLVM IR); the fit check stops there.
SHARED_MEMORY_STAGE = "llir"


def _compile_shared(kernel, signature, constexprs, attrs, target, options: dict) -> "int | tuple[str, str]":
    """Bytes of shared memory one program of ``kernel`` needs on ``target`` (a worker of
    :func:`_compile_pool`), or ``(exception type name, message)`` when it does not compile (kept
    as text: a cached exception would hold, through its traceback, every frame that re-raised it).

    Runs Triton's pipeline as ``triton.compile`` does (front end, then the backend's stages)
    but only through :data:`SHARED_MEMORY_STAGE`, and writes nothing into Triton's cache: the
    PTX and cubin stages (about half of a compile: on an H200 with Triton 3.6 an attention
    kernel's ttir+ttgir+llir take 0.4-0.6 s, ptx+cubin 0.4-0.7 s) are left to the compile that
    launches the kernel, Inductor's. That compile cannot be this one: Triton keys its cache on a
    kernel's source *and its first line number*, and Inductor's copy of a user kernel sits at
    another line of its generated module, so a full compile here was always a second one (two
    cache entries per kernel and config, measured on the H200, 2026-12-03). Should the partial
    pipeline fail (Triton's internals not as expected, or the kernel does not compile), a full
    ``triton.compile`` gives the bytes or the error."""
    import inspect

    from triton._C.libtriton import ir
    from triton.compiler import ASTSource, make_backend

    try:
        backend = make_backend(target)
        src = ASTSource(kernel, signature, constexprs, attrs)
        opts = backend.parse_options(dict(options, **src.parse_options()))
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        front = (backend.get_codegen_implementation(opts), backend.get_module_map(), context)
        # Triton 3.9 passes the target first; 3.6 does not
        takes_target = "target" in inspect.signature(src.make_ir).parameters
        with _frontend_lock:
            module = src.make_ir(target, opts, *front) if takes_target else src.make_ir(opts, *front)
        metadata = {"hash": "", "target": target, **opts.__dict__}
        stages: dict = {}
        backend.add_stages(stages, opts, src.language)
        for ext, lower in stages.items():
            module = lower(module, metadata)
            if ext == SHARED_MEMORY_STAGE:
                return int(metadata["shared"])
        raise LookupError(f"Triton's {target.backend} backend has no {SHARED_MEMORY_STAGE!r} stage: {list(stages)}")
    except Exception as exc:  # noqa: BLE001 - a full compile says whether the kernel compiles at all
        log.debug("fuser: the partial compile of %s failed (%s: %s); compiling it fully", _kernel_name(kernel),
                  type(exc).__name__, exc)
    # Triton's internals differ from what this expects, or the kernel does not compile: the full
    # compile (which also fills Triton's cache) gives the bytes or the error
    from triton.compiler import compile as triton_compile

    try:
        with _frontend_lock:
            return int(triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options).metadata.shared)
    except Exception as exc:  # noqa: BLE001 - raised again, afresh, by whoever asks
        return (type(exc).__name__, str(exc))


def _compile_and_remember(disk_key: str, *compile_args) -> "int | tuple[str, str]":
    """:func:`_compile_shared`, its bytes also written to ``<cache>/shared_memory.json``."""
    need = _compile_shared(*compile_args)
    if isinstance(need, int):
        _shared_store(disk_key, need)
    return need


#: What the fit checks of this process did (:func:`fit_check_stats`): ``asked`` calls of
#: :func:`compiled_shared_memory`, answered from ``memory`` or from ``disk``
#: (``shared_memory.json``), ``compiles`` started, and ``wait_s``: seconds the callers spent
#: waiting for a compile's answer (on the calling thread: the time a first call is held up).
_fit_stats = {"asked": 0, "memory": 0, "disk": 0, "compiles": 0, "wait_s": 0.0}


def fit_check_stats() -> dict:
    """A copy of this process's fit-check counters (``asked``, ``memory``, ``disk``, ``compiles``,
    ``wait_s``: see :data:`_fit_stats`), e.g. for ``benchmarks/compile_time.py``'s account of a
    first call. Cumulative since import."""
    with _shared_lock:
        return dict(_fit_stats)


def _count(field: str, amount=1) -> None:
    with _shared_lock:
        _fit_stats[field] += amount


class KernelCompileError(RuntimeError):
    """A kernel did not compile for :func:`compiled_shared_memory` (the message names Triton's
    exception and says what it said)."""


def compiled_shared_memory(kernel, args: Sequence[Any], kwargs: dict, target) -> int | None:
    """Bytes of shared memory ``kernel[grid](*args, **kwargs)`` needs per program, compiled for
    Triton ``target`` (:func:`compile_target`) without a device: no launch, no GPU needed.

    ``kernel``: a ``@triton.jit`` function (``JITFunction``); ``args``/``kwargs``: the launch's
    arguments (tensors may be fake or functional: only their dtypes are read, pointers are taken
    as 16-byte aligned), including the constexprs, ``num_warps`` and ``num_stages``. Triton's own
    binder gives the signature and specialisation (as its launcher would), Triton's pipeline
    lowers it through LLVM IR (:func:`_compile_shared`: no PTX, no cubin, nothing in Triton's
    cache), and the result is ``metadata.shared``: the bytes Triton's launcher compares with the
    device's limit. Kept per (Triton version, kernel source hash, specialisation, options,
    target, Triton's cache-invalidating environment variables) in memory and in ``<cache>/shared_memory.json``, so a later process with the same
    cache compiles nothing for this; a miss costs the front half of a compile (0.4-0.6 s for an
    attention kernel on an H200 host, 1-2 s on a 2-core CPU). The compile runs on a thread of
    :func:`_compile_pool`: inside :func:`prefetching` this returns None at once (the compile
    goes on in the background, and a later call with the same key waits for it); otherwise it
    waits. Uses Triton's ``create_function_from_signature`` and ``JITFunction._pack_args`` (the
    same in Triton 3.6 and 3.9).

    Raises:
        KernelCompileError: the kernel does not compile (not inside :func:`prefetching`).
    """
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    tkey = (target.backend, target.arch, target.warp_size)
    with _shared_lock:
        entry = _binders.get((id(kernel), tkey))
        if entry is None or entry[0] is not kernel:
            backend = make_backend(target)
            entry = _binders[(id(kernel), tkey)] = (kernel, backend,
                                                    create_function_from_signature(kernel.signature, kernel.params,
                                                                                   backend))
    _, backend, binder = entry
    margs, mkw = _mock_args(args), dict(zip(kwargs, _mock_args(kwargs.values())))
    bound, specialization, options = binder(*margs, **mkw)
    with _frontend_lock:
        cache_key = kernel.cache_key
    key = (cache_key, repr(specialization), repr(sorted(options.items())) if isinstance(options, dict) else repr(options), tkey)
    with _shared_lock:
        _fit_stats["asked"] += 1
        need = _shared_needs.get(key)
        if need is not None:
            _fit_stats["memory"] += 1
    if need is None:
        import triton

        disk_key = "|".join((triton.__version__, *key[:3], repr(tkey), _invalidating_env()))
        need = _json_record(_shared_file()).get(disk_key)
        if need is not None:
            _count("disk")
            with _shared_lock:
                _shared_needs.setdefault(key, need)
    if need is None:
        opts, signature, constexprs, attrs = kernel._pack_args(backend, mkw, bound, specialization, options)
        compile_args = (disk_key, kernel, signature, constexprs, attrs, target, dict(opts.__dict__))
        pool = _compile_pool() if COMPILE_THREADS > 0 else None
        with _shared_lock:
            need = _shared_needs.get(key)
            if need is None and pool is not None:
                _fit_stats["compiles"] += 1
                need = _shared_needs[key] = pool.submit(_compile_and_remember, *compile_args)
        if need is None:  # FUSER_COMPILE_THREADS=0: on this thread
            _count("compiles")
            t0 = time.perf_counter()
            need = _compile_and_remember(*compile_args)
            _count("wait_s", time.perf_counter() - t0)
            with _shared_lock:
                _shared_needs[key] = need
    if prefetching_now():
        return None
    if not isinstance(need, (int, tuple)):  # a Future
        t0 = time.perf_counter()
        need = need.result()
        _count("wait_s", time.perf_counter() - t0)
        with _shared_lock:
            _shared_needs[key] = need
    if isinstance(need, tuple):
        raise KernelCompileError(f"kernel {_kernel_name(kernel)} does not compile for {target}: {need[0]}: {need[1]}")
    return need


def shared_memory_need(kernel, grid, args: Sequence[Any], kwargs: dict, device: torch.device) -> int:
    """Bytes of shared memory one launch of ``kernel`` needs per program on CUDA ``device``.

    While traced (fake tensors): :func:`compiled_shared_memory` for the device's target. When
    the op runs: Triton's ``kernel.warmup`` with the real arguments, which compiles the kernel
    exactly as the launch that follows will (same specialisation, kept in Triton's kernel
    cache, so that launch does not compile again) without launching it; its ``metadata.shared``.
    """
    if tracing():
        return compiled_shared_memory(kernel, args, kwargs, compile_target(device))
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    return int(compiled.metadata.shared)


class _Unchecked(BaseException):
    """Ends a dry run (:func:`check_fit`) at a launch nothing can check: no limit on its device,
    or its compile step failed. (A ``BaseException``, as :class:`_TooLarge`: control flow that an
    ``except Exception`` in a launcher must not swallow.)"""


class _TooLarge(BaseException):
    """Ends a dry run at the first launch that does not fit."""

    def __init__(self, name: str, need: int, limit: int, device) -> None:
        super().__init__(name, need, limit, device)
        self.name, self.need, self.limit, self.device = name, need, limit, device


_dry = threading.local()
_warned_unchecked: set = set()


def _kernel_name(kernel) -> str:
    return getattr(getattr(kernel, "fn", None), "__name__", None) or repr(kernel)


class _DryLaunch:
    """What :func:`jit_call` gives during :func:`check_fit`'s dry run: checks the launch
    (``need`` against ``limit``) instead of making or recording it."""

    def __init__(self, kernel, need, limit) -> None:
        self.kernel, self.need, self.limit = kernel, need, limit

    def __getitem__(self, grid):
        def check(*args, **kwargs):
            first = _first_tensor(args, kwargs)
            limit = None if first is None else self.limit(first.device)
            name = _kernel_name(self.kernel)
            if limit is None:
                raise _Unchecked(name)
            if prefetching_now():  # start the compile, check nothing: the traced run checks
                try:
                    self.need(self.kernel, grid, args, kwargs, first.device)
                except Exception:  # noqa: BLE001 - the traced run meets it again and says so
                    pass
                return
            try:
                need = self.need(self.kernel, grid, args, kwargs, first.device)
            except Exception as exc:  # noqa: BLE001 - the real launch raises it again if it is real
                if name not in _warned_unchecked:
                    _warned_unchecked.add(name)
                    log.warning("fuser: cannot tell how much shared memory kernel %s needs (%s: %s); its config "
                                "is launched unchecked", name, type(exc).__name__, exc)
                raise _Unchecked(name) from exc
            if need > limit:
                raise _TooLarge(name, need, limit, first.device)

        return check


class Fit(NamedTuple):
    """:func:`check_fit`'s answer. ``ok``: every launch fits (or nothing could be checked:
    ``checked`` false). When ``ok`` is false, ``kernel`` (name), ``need`` and ``limit`` (bytes of
    shared memory per program) and ``device`` are those of the first launch that does not fit."""

    ok: bool
    checked: bool
    kernel: str | None = None
    need: int | None = None
    limit: int | None = None
    device: Any = None


def check_fit(run: Callable[[dict], Any], config: dict, *, need: Callable | None = None,
              limit: Callable | None = None) -> Fit:
    """Whether every kernel ``run(config)`` launches fits the shared memory of its device,
    decided without launching anything.

    ``run(config)`` is called as a dry run: each launch through :func:`jit_call` is checked
    instead of made (or recorded for Inductor), in order, and the run ends at the first that
    does not fit. Tensor work in ``run`` between launches (allocations, zeroing) does happen, so
    ``run`` must be safe to call again (as :func:`launch_first_fitting` requires).

    Args:
        need: ``need(kernel, grid, args, kwargs, device)``, the bytes of shared memory per program
            of one launch; default :func:`shared_memory_need` (a compile, no launch).
        limit: ``limit(device)``, the device's bytes per program, or None where nothing is
            checked; default :func:`shared_memory_limit`.

    Returns:
        :class:`Fit`. Taken as fitting unchecked (``ok`` true, ``checked`` false) when the run
        meets a launch whose device has no limit (CPU tensors), when the compile step fails
        (logged once per kernel; the real launch will show the error), or when ``run`` itself
        raises (the real run raises it again). Only shared memory is checked: registers are
        known only once Triton loads the binary onto the GPU, and Blackwell's tensor memory is
        not checked.
    """
    need = need or (lambda *a: shared_memory_need(*a))
    limit = limit or (lambda device: shared_memory_limit(device))
    try:
        with _set_in_thread(_dry, "check", (need, limit)):
            run(config)
    except _Unchecked:
        return Fit(True, False)
    except _TooLarge as e:
        return Fit(False, True, e.name, e.need, e.limit, e.device)
    except Exception as exc:  # noqa: BLE001 - inconclusive: the real run raises it again
        log.debug("fuser: dry run of config %s raised %s: %s", config, type(exc).__name__, exc)
        return Fit(True, False)
    return Fit(True, True)


_fitting: dict[tuple, dict] = {}
_checked: dict[tuple, Fit] = {}


def _checked_fit(key, run, cfg: dict, need, limit) -> Fit:
    """:func:`check_fit`, remembered per (key, config) when something was checked (the launches
    of a config that was checked once, e.g. while autotuning, are not compiled again when the
    winner is traced)."""
    try:
        ckey = (key, tuple(sorted(cfg.items())), need, limit)
        hash(ckey)
    except TypeError:
        ckey = None
    fit = _checked.get(ckey) if ckey is not None else None
    if fit is None:
        fit = check_fit(run, cfg, need=need, limit=limit)
        if fit.checked and ckey is not None:
            _checked[ckey] = fit
    return fit


def launch_first_fitting(key: tuple, configs: list[dict], run: Callable[[dict], Any], *,
                         need: Callable | None = None, limit: Callable | None = None) -> None:
    """``run(config)`` with the first of ``configs`` whose kernels fit the device's shared memory.

    A default config can exceed shared memory for some variants (e.g. a full [M, N] additive
    bias tile per pipeline stage). Each config is first checked without launching anything
    (:func:`check_fit`: ``run`` as a dry run, each kernel launch compiled and its ``metadata.shared``
    bytes compared with the device's per-block opt-in limit, :func:`shared_memory_limit`), and
    the first that fits is run. This matters most while the op is traced for Inductor
    (:func:`tracing`): the launches are recorded, not compiled, and a config that does not fit
    would fail only when the compiled program first runs. The config that ran (or was recorded)
    is remembered per ``key`` (which must identify the kernels, their constexprs other than the
    config's, and the device kind), so later calls with the same key neither check nor compile;
    so is each checked config's answer, per key and config.

    Cost, once per key: a dry run of ``run`` per config tried (its tensor work is done, its
    launches are not) and one compile of each kernel checked. When the op runs, that compile is
    the launch's own (Triton's ``warmup``, kept in its cache); while traced it is a compile of the
    kernel for the device's target in addition to Inductor's (1-3 s per attention kernel on a
    2-core CPU; the second config is compiled only when the first does not fit), and the tensor
    work of the dry runs is traced too (dead: Inductor removes it). Nothing is compiled for CPU
    tensors (Triton's interpreter), whose dry run ends at its first launch.

    When the op runs, Triton's ``OutOfResources`` (a resource the check does not cover, e.g.
    threads or registers) still moves on to the next config, as a fallback.

    Args:
        key: identifies the problem (hashable); see above.
        configs: configs in order of preference; a list of one is an explicit config, never
            replaced by another.
        run: launches the kernels with one config (through :func:`jit_call`); must be safe to call
            again (a dry run, a retry), and must not read what its kernels wrote.
        need, limit: the compile step and the device limit (:func:`check_fit`); tests pass fakes.

    Raises:
        ConfigDoesNotFit: no config fits (an explicit config that does not fit included); the
            message names each config's first kernel that does not fit, its bytes and the limit.
        OutOfResources: (from Triton, when the op runs) the last config does not fit in a way
            the check missed.
    """
    if not configs:
        raise ValueError(f"launch_first_fitting: no configs for {key}")
    known = _fitting.get(key)
    start = configs.index(known) if known is not None and known in configs else None
    if prefetching_now():  # start the compiles the traced run will check; remember nothing
        for cfg in ([configs[start]] if start is not None else configs[:PREFETCH_CONFIGS]):
            check_fit(run, cfg, need=need, limit=limit)
        return
    if start is None:
        too_large = []
        for i, cfg in enumerate(configs):
            fit = _checked_fit(key, run, cfg, need, limit)
            if fit.ok:
                start = i
                break
            log.info("fuser: config %s of %s does not fit: kernel %s needs %d bytes of shared memory, %s has %d",
                     cfg, key, fit.kernel, fit.need, fit.device, fit.limit)
            too_large.append((cfg, fit))
        if start is None:
            f0 = too_large[0][1]
            raise ConfigDoesNotFit(key, [(c, f.kernel, f.need) for c, f in too_large], f0.limit, f0.device)
    if tracing():  # recorded for Inductor: the check above is all there is
        run(configs[start])
        _fitting[key] = configs[start]
        return
    for i in range(start, len(configs)):
        try:
            run(configs[i])
        except Exception as exc:  # noqa: BLE001 - only OutOfResources is retried
            if type(exc).__name__ != "OutOfResources" or i == len(configs) - 1:
                raise
            log.info("fuser: config %s of %s: %s; trying the next", configs[i], key, exc)
            continue
        _fitting[key] = configs[i]
        return


#: How many configs of a :func:`launch_first_fitting` call :func:`prefetching` compiles ahead
#: (the second is compiled when the first does not fit, as for an additive mask's forward on an H100)
PREFETCH_CONFIGS = 2
_prefetch = threading.local()


def prefetching_now() -> bool:
    """Whether this thread is inside :func:`prefetching`."""
    return getattr(_prefetch, "on", False)


def prefetching():
    """Within: the fit checks of :func:`launch_first_fitting` start their kernels' compiles
    (:func:`compiled_shared_memory`, in the background) for its first :data:`PREFETCH_CONFIGS`
    configs (the one remembered for its key, when there is one) and check, run, record and
    remember nothing. :func:`prefetch_compiles` traces a fused op's call so: the traced run that
    follows (AOTAutograd's, for Inductor) then finds its compiles done or under way, all started
    together instead of one after another as it meets them."""
    return _set_in_thread(_prefetch, "on", True, False)


def prefetch_compiles(op, args: Sequence[Any], kwargs: dict, *, grad: bool) -> bool:
    """Start the compiles that tracing ``op(*args, **kwargs)`` for Inductor will check
    (:func:`prefetching`): its forward and, when ``grad`` and an input requires grad, its
    backward (autograd's, through the op's formula), traced as AOTAutograd traces them (fake
    tensors, functionalised) but recording nothing. ``op``: a fused op (:func:`fused_op`);
    ``args``/``kwargs``: the call's arguments, tensors fake (the graph's example values).

    Returns whether the trace ran: not with ``FUSER_COMPILE_THREADS=0`` (:data:`COMPILE_THREADS`),
    not for calls that keep the opaque op
    (:func:`stays_opaque`: CPU, symbolic sizes, whose trace could add a guard to the caller's
    shape environment), or when the trace failed (the real one meets the
    same failure and reports it; nothing here changes what is compiled or run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._pytree import tree_flatten, tree_unflatten

    if (COMPILE_THREADS <= 0 or _op_name(op) not in _FUSED_OPS or stays_opaque(args, kwargs, op) is not None
            or _symbolic(args, kwargs)):
        return False
    flat, spec = tree_flatten((list(args), dict(kwargs)))
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    # stand-ins of the same sizes, strides, dtypes, devices and requires_grad in a fake mode of
    # their own: the graph's example values may come from several fake modes (DDPOptimizer's
    # pieces mix its inputs' with Dynamo's), and this trace must add nothing to theirs
    fake_mode = FakeTensorMode()

    def stand_in(x: torch.Tensor) -> torch.Tensor:
        t = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device=x.device)
        return t.requires_grad_(x.requires_grad and (x.dtype.is_floating_point or x.dtype.is_complex))

    def joint(*tensors):
        vals = list(flat)
        for i, t in zip(where, tensors):
            vals[i] = t
        a, kw = tree_unflatten(vals, spec)
        out = op(*a, **kw)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        ins = [t for t in tensors if t.requires_grad]
        if grad and outs and ins:
            torch.autograd.grad(outs, ins, [torch.ones_like(o) for o in outs], allow_unused=True)

    try:
        with fake_mode, prefetching(), torch.set_grad_enabled(grad):
            make_fx(dispatch_functionalize(joint))(*[stand_in(flat[i]) for i in where])
    except Exception as exc:  # noqa: BLE001 - see above
        log.debug("fuser: prefetching the compiles of %s failed (%s: %s)", _op_name(op), type(exc).__name__, exc)
        return False
    return True


def tracing() -> bool:
    """True while tensors are fake or functional: a fused op's body is being traced (Dynamo's
    fake propagation, AOTAutograd's functionalisation that hands the kernels to Inductor), not
    run. Launchers then choose configs without timing (:func:`autotune`) and without retrying,
    by compiling (:func:`launch_first_fitting`), and launch through ``torch.library.wrap_triton``."""
    from torch._C import _get_dispatch_mode, _TorchDispatchModeKey

    return any(_get_dispatch_mode(k) is not None
               for k in (_TorchDispatchModeKey.FAKE, _TorchDispatchModeKey.FUNCTIONAL, _TorchDispatchModeKey.PROXY))


#: Fused ops on the GPU hand their kernels to Inductor (:func:`inline_into_inductor`); with
#: ``FUSER_OPAQUE_OPS=1`` (read at import) they stay opaque custom ops that launch their kernels
#: from Python on every call, as every op does on the CPU (the interpreter) — for comparison.
INLINE_INTO_INDUCTOR = os.environ.get("FUSER_OPAQUE_OPS", "0") != "1"
#: The device types whose calls are inlined (tests on a CPU-only torch trace with "meta" tensors
#: standing for CUDA ones: fake CUDA tensors cannot ``copy_`` there).
INLINE_DEVICE_TYPES = ("cuda",)


def _symbolic(args, kwargs) -> bool:
    """True when a size, stride or integer argument of the call is symbolic (dynamic shapes)."""
    def sym(x) -> bool:
        if isinstance(x, (torch.SymInt, torch.SymFloat)):
            return True
        if isinstance(x, torch.Tensor):
            return any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))
        if isinstance(x, (list, tuple)):
            return any(sym(y) for y in x)
        return False

    return any(sym(a) for a in list(args) + list(kwargs.values()))


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b
    return None


_size_guards = threading.local()


def without_size_guards():
    """Within: :func:`at_most` decides from the sizes' value ranges alone and adds no guard
    (``fuser.export``'s check of an exported program: an AOTInductor package has no recompile to
    fall back on, so a size its graph might not serve must be ruled out by the dims' bounds)."""
    return _set_in_thread(_size_guards, "off", True, False)


def proven(cond) -> bool:
    """Whether a condition on sizes holds for every size the graph being traced serves, without
    adding a guard: a ``bool`` as it is; a ``SymBool`` (dynamic shapes) only where the shape
    environment proves it from the dims' ranges and relations (``statically_known_true``), else
    false. For choices where "false" is always safe (e.g. visiting every tile instead of skipping
    some): an unproven case takes the general path rather than specialising the trace."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(cond))


def same_sizes(a: Sequence, b: Sequence) -> bool:
    """``a == b`` for two sequences of sizes that may hold SymInts: the same length and every pair
    :func:`proven` equal (no guard; unproven counts as different)."""
    return len(a) == len(b) and all(x is y or proven(x == y) for x, y in zip(a, b))


def at_most(size, limit: int) -> bool:
    """Whether ``size <= limit`` holds for every value ``size`` takes in the graph being traced.

    An ``int`` is compared. A ``SymInt`` (dynamic shapes): true where its value range proves it
    (the dims' bounds, e.g. ``mark_dynamic(x, 0, max=...)`` or an export ``Dim(max=...)``); false
    where a bound given by the user allows a larger value (a guard would contradict the bound:
    Dynamo refuses such a compile) or inside :func:`without_size_guards`; otherwise, for a
    dim unbounded above, decided with a guard — the graph then serves the sizes that pass it, and
    past it Dynamo compiles again, where this returns false.
    """
    if isinstance(size, int):
        return size <= limit
    import sympy

    node = size.node
    upper = node.shape_env.bound_sympy(node.expr).upper
    if isinstance(upper, (int, sympy.Integer)):  # bounded: decided by the bound, never a guard
        return int(upper) <= limit
    if getattr(_size_guards, "off", False):
        return False
    return bool(size <= limit)  # unbounded: a guard


def symbolic_launch_fits(static: Sequence, rows, what: str = "a symbolic head dim or head count") -> str | None:
    """The part every op's ``symbolic`` rule (:func:`fused_op`) shares: why launches traced with
    these symbolic sizes would not serve every size, or None. ``static``: the sizes the op's
    kernels or configs are chosen from (head dims, head counts, ...), which must be ints (a
    symbolic one gives ``what``); ``rows``: the largest grid-axis-1 extent of its launches
    (B·H), which must fit one launch grid for every size (:func:`at_most`: from the dims' bounds,
    or one guard for a dim unbounded above), since a traced launch cannot be sliced."""
    if not all(isinstance(d, int) for d in static):
        return what
    if not at_most(rows, MAX_GRID_ROWS):
        return f"{rows} rows may exceed what one launch grid holds ({MAX_GRID_ROWS})"
    return None


#: Per fused op (``"fuser::kda"``): the rule that lets a call with symbolic sizes hand its
#: kernels to Inductor (:func:`fused_op`'s ``symbolic``). Ops not here keep the opaque op then.
_SYMBOLIC_RULES: dict[str, Callable[[tuple, dict], "str | None"]] = {}


def _op_name(op) -> str | None:
    if op is None or isinstance(op, str):
        return op
    schema = getattr(op, "_schema", None)
    return schema.name if schema is not None else None


def stays_opaque(args, kwargs, op=None) -> str | None:
    """Why a fused op's call with these arguments (real, fake or functional tensors) keeps the
    opaque op instead of handing its kernels to Inductor (:func:`inline_into_inductor`), or None:
    ``"opaque ops"`` (``FUSER_OPAQUE_OPS=1``), ``"device"`` (no tensor, or its first tensor not on
    a device of :data:`INLINE_DEVICE_TYPES`), ``"symbolic sizes"`` (dynamic shapes, where ``op``
    (its name ``"fuser::kda"`` or an overload) has no ``symbolic`` rule in :func:`fused_op`, or
    its rule says this call's body would specialise a size)."""
    if not INLINE_INTO_INDUCTOR:
        return "opaque ops"
    first = _first_tensor(args, kwargs)
    if first is None or first.device.type not in INLINE_DEVICE_TYPES:
        return "device"
    if _symbolic(args, kwargs):
        rule = _SYMBOLIC_RULES.get(_op_name(op))
        if rule is None or rule(args, kwargs) is not None:
            return "symbolic sizes"
    return None


#: the names of the ops :func:`fused_op` made (``"fuser::attention"``)
_FUSED_OPS: set[str] = set()


def is_fused_op(target) -> bool:
    """Whether ``target`` (an FX node's target: an op overload or packet) is an op of :func:`fused_op`."""
    name = _op_name(target) or _op_name(getattr(target, "default", None))
    return name in _FUSED_OPS


def fused_op(name: str, *, mutates_args=(),
             symbolic: Callable[[tuple, dict], "str | None"] | None = None) -> Callable[[Callable[..., Any]], Any]:
    """``torch.library.custom_op(name, mutates_args=...)`` whose GPU kernels Inductor launches
    (:func:`inline_into_inductor`); the decorated function is the op's body for both.

    ``symbolic``: for a call whose sizes are symbolic (dynamic shapes), ``symbolic(args, kwargs)``
    says why it must keep the opaque op (a string), or None when its body, traced with those
    sizes, specialises none of them: no Python branch, ``int()`` or config choice on a symbolic
    size, so that Dynamo's shape environment gains no guard and every size the compiled graph
    serves runs the kernels it recorded (the op's tests trace it with symbolic sizes and check
    that no guard appeared). Without a rule (the default) such calls stay opaque."""

    def decorate(fn: Callable[..., Any]):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        _FUSED_OPS.add(name)
        if symbolic is not None:
            _SYMBOLIC_RULES[name] = symbolic
        inline_into_inductor(op, fn)
        return op

    return decorate


def inline_into_inductor(op, impl: Callable[..., Any]) -> None:
    """Let Inductor launch the GPU kernels of the custom op ``op`` as its own.

    ``op`` (a ``torch.library.custom_op``) keeps its fake implementation and autograd formula:
    Dynamo and AOTAutograd's joint graph see one opaque op. When AOTAutograd functionalises the
    graph, a GPU call of ``op`` is replaced by a trace of ``impl`` (the op's Python body) on
    fake tensors: its tensor ops, and each kernel launch recorded through
    ``torch.library.wrap_triton`` (every template launches through :func:`jit_call`). Inductor
    then compiles those kernels with its own (in its parallel compile workers, at compile time)
    and launches them from its generated wrapper (``TORCH_LOGS=output_code`` shows them): the
    per-call cost of the op's dispatch, our Python and Triton's launcher disappears. This is
    what ``torch.library.triton_op`` does, with two differences: CPU tensors (kernels in
    Triton's interpreter, which Inductor cannot launch) keep the opaque op, and the kernels are
    rendered per variant, so they are not listed up front.

    ``impl`` must be traceable with fake tensors: no data-dependent Python, configs chosen
    without timing (:func:`autotune` and :func:`launch_first_fitting` know when they are traced).
    A call with symbolic sizes (dynamic shapes) keeps the opaque op unless the op's ``symbolic``
    rule (:func:`fused_op`) lets it through: most bodies choose configs and kernels from sizes
    (power-of-two buckets, block counts), which would specialise the compiled graph to one size
    and recompile it for every other. ``torch.export`` keeps the op
    whole (as it does triton ops).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    known = (torch.Tensor, FakeTensor, FunctionalTensor)

    def decompose(mode, func, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if stays_opaque(args, kwargs, func) is not None or custom_triton_ops_decomposition_disabled():
            return mode.__torch_dispatch__(func, types, args, kwargs)
        if any(t not in known for t in types):
            return NotImplemented
        with mode:
            return impl(*args, **kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, decompose)


#: Inductor's analysis of which arguments a user-defined Triton kernel reads and writes, by the
#: names torch has had for it (``identify_accessed_tensors``; before, ``identify_mutated_tensors``)
ACCESS_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
#: :func:`access_analysis_stats`: calls of Inductor's analysis for fuser's kernels, answers from
#: the memo, seconds spent in the analyses that ran, which functions were wrapped, and the
#: kernels whose analysis failed (torch then assumes they write every tensor they take)
_access_stats: dict = {"calls": 0, "memo": 0, "run_s": 0.0, "wrapped": [], "failed": []}
_access_memo: dict = {}
_our_kernels: "weakref.WeakSet" = weakref.WeakSet()


def access_analysis_stats() -> dict:
    """A copy of the counters of :func:`_memoize_access_analysis`: ``calls`` (Inductor asked
    about one of fuser's kernels), ``memo`` (answered from the memo), ``run_s`` (seconds in the
    analyses that ran), ``wrapped`` (the torch functions wrapped; empty: none, so every call ran
    torch's analysis as it is), ``failed`` (names of fuser's kernels torch's analysis could not
    analyse: a fuser bug, warned about once per kernel)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in _access_stats.items()}


def _base_kernel(kernel):
    """The ``JITFunction`` of ``kernel``: itself, or that of the ``Autotuner`` around it."""
    from triton.runtime.autotuner import Autotuner

    return kernel.fn if isinstance(kernel, Autotuner) else kernel


def _access_key(kernel, kwargs, tma_descriptor_metadata):
    """What Inductor's access analysis of ``kernel`` depends on, or None when this cannot say:
    it lowers the kernel to TTIR with a 2-element tensor of each tensor argument's dtype, 2 for
    each symbolic size and the other values as they are, and reads the tensor arguments' loads
    and stores from it; so the key is the kernel and, per argument name, the dtype of a tensor
    (fake or Inductor's ``TensorBox``), "symbolic", or the value of a plain Python scalar; for
    the ``Autotuner`` that ``wrap_triton`` wraps a launch's ``num_warps``/``num_stages`` in (a new
    one per launch), its kernel and its configs."""
    from triton.runtime.autotuner import Autotuner

    configs = ()
    if isinstance(kernel, Autotuner):
        try:
            configs = tuple((tuple(sorted(c.kwargs.items())), getattr(c, "num_warps", None),
                             getattr(c, "num_stages", None), getattr(c, "num_ctas", None),
                             getattr(c, "pre_hook", None) is None) for c in kernel.configs)
            hash(configs)
        except TypeError:
            return None
    kernel = _base_kernel(kernel)
    if tma_descriptor_metadata or kernel not in _our_kernels:
        return None
    import sympy

    items = []
    for name in sorted(kwargs):
        v = kwargs[name]
        if isinstance(v, torch.Tensor):
            items.append((name, "tensor", v.dtype))
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
            items.append((name, "symbolic"))
        elif v is None or isinstance(v, (bool, int, float, str)):
            items.append((name, type(v).__name__, v))
        elif callable(getattr(v, "get_dtype", None)) and type(v).__name__ == "TensorBox":
            items.append((name, "tensor", v.get_dtype()))
        else:
            return None
    return (id(kernel), configs, tuple(items))


class _AnalysisFailures(logging.Handler):
    """Collects, while open, torch's log record saying its access analysis of a kernel failed
    ("Encountered an exception in identify_accessed_tensors, assuming every input is mutated";
    torch catches the exception itself and answers that every tensor argument is written).
    Best effort: it sees the record only where torch logs it, so with the ``torch._dynamo``
    logger set above WARNING (``TORCH_LOGS="-dynamo"``, ``logging.disable``) nothing is
    reported; the answer itself is torch's either way."""

    def __init__(self, logger: logging.Logger):
        super().__init__(logging.WARNING)
        self.logger = logger  # the module's ``log`` (torch 2.13: "torch._dynamo")
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:  # never raise into torch's own fallback
            msg = record.getMessage()
            if "assuming every input is mutated" in msg:
                exc = record.exc_info[1] if record.exc_info else None
                last = (str(exc).strip().splitlines() or [""])[-1] if exc is not None else ""
                self.messages.append(f"{type(exc).__name__}: {last}" if exc is not None else msg)
        except Exception:  # noqa: BLE001
            self.handleError(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        return False


#: the kernels :func:`_analysis_failed` warned about
_analysis_warned: "weakref.WeakSet" = weakref.WeakSet()


def _analysis_failed(kernel, why: str) -> None:
    """Torch's access analysis failed for fuser's ``kernel``: Inductor then copies every tensor
    the kernel takes (the fused op's inputs included) before each launch and skips CUDA graphs
    for the graph ("mutated inputs"). The values stay right; the time does not. Warns once per
    kernel (each rendered variant; a fuser bug to report) and lists its name in
    :func:`access_analysis_stats`."""
    if kernel in _analysis_warned:  # each rendered variant once (variants share a function name)
        return
    _analysis_warned.add(kernel)
    name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))
    _access_stats["failed"].append(name)
    import warnings

    warnings.warn(f"fuser: torch's analysis of which arguments kernel {name} writes failed ({why}); Inductor "
                  f"will copy the fused op's inputs before every call and run the graph without CUDA graphs. "
                  f"Results are unaffected; this is a fuser bug (torch {torch.__version__}), please report it",
                  RuntimeWarning, stacklevel=2)


def _memoize_access_analysis() -> None:
    """Wraps Inductor's access analysis of user-defined Triton kernels (:data:`ACCESS_ANALYSES`)
    with a memo for fuser's kernels (those launched through :class:`_TracedLaunch`); other
    kernels go to torch's function as before. Why: torch runs the analysis for every traced
    launch, several times (functionalisation in AOTAutograd's metadata pass and again in its
    joint trace, Inductor's lowering, its graph passes), each a lowering of the kernel's source to
    TTIR on the main thread; a 4-layer Llama training step launches the same few kernels per
    layer. The answer is a function of :func:`_access_key` (the inputs torch's analysis reads);
    each caller gets its own deep copy. Does nothing where torch has none of these functions or
    they take other parameters."""
    import copy
    import inspect

    try:
        from torch._higher_order_ops import triton_kernel_wrap as tkw
    except ImportError:
        return
    torch_log = getattr(tkw, "log", None) or logging.getLogger(tkw.__name__)  # where it logs a failure
    for name in ACCESS_ANALYSES:
        real = getattr(tkw, name, None)
        if real is None or getattr(real, "_fuser_memo", False):
            continue
        try:
            params = list(inspect.signature(real).parameters)
        except (TypeError, ValueError):
            continue
        if params != ["kernel", "kwargs", "tma_descriptor_metadata"]:
            continue

        def memoized(kernel, kwargs, tma_descriptor_metadata, _real=real):
            key = _access_key(kernel, kwargs, tma_descriptor_metadata)
            if key is None:
                return _real(kernel, kwargs, tma_descriptor_metadata)
            _access_stats["calls"] += 1
            base = _base_kernel(kernel)
            hit = _access_memo.get(key)
            if hit is not None and hit[0] is base:
                _access_stats["memo"] += 1
                return copy.deepcopy(hit[1])
            t0 = time.perf_counter()
            with _AnalysisFailures(torch_log) as failures:
                got = _real(kernel, kwargs, tma_descriptor_metadata)
            _access_stats["run_s"] += time.perf_counter() - t0
            if failures.messages:
                _analysis_failed(base, failures.messages[0])
            _access_memo[key] = (base, got)
            return copy.deepcopy(got)

        memoized._fuser_memo = True
        memoized.__wrapped__ = real
        memoized.__doc__ = real.__doc__
        setattr(tkw, name, memoized)
        _access_stats["wrapped"].append(name)


class _TracedLaunch:
    """``wrap_triton(kernel)[grid]`` that first checks the launch's float arguments (see
    :func:`jit_call`)."""

    def __init__(self, kernel) -> None:
        from torch.library import wrap_triton

        self.kernel = kernel
        self.wrapped = wrap_triton(kernel)
        if kernel not in _our_kernels:
            _our_kernels.add(kernel)
            _memoize_access_analysis()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.check_floats(args, kwargs)
            return self.wrapped[grid](*args, **kwargs)

        return launch

    def check_floats(self, args, kwargs) -> None:
        params = {p.name: p for p in self.kernel.params}
        named = list(zip(self.kernel.arg_names, args)) + list(kwargs.items())
        for name, value in named:
            p = params.get(name)
            if p is None or p.is_constexpr or not isinstance(value, float):
                continue
            if f"{name} = tl.cast({name}, tl.float32)" not in self.kernel.src:
                raise RuntimeError(
                    f"fuser bug: kernel {self.kernel.fn.__name__} takes the float argument {name!r} without "
                    f"`{name} = tl.cast({name}, tl.float32)` at its entry; Inductor passes Python floats to the "
                    f"kernels it launches as float64 (Triton's own launcher: float32), so the kernel would "
                    f"compute in float64 or fail to compile. Please report it.")


#: CUDA's largest grid size along a launch's second (and third) axis, ``gridDim.y``. Templates put
#: the rows a kernel runs over (batch × heads, N = B·H) on that axis; :func:`jit_call` splits a
#: launch with more rows into several (:class:`_RowLaunch`). Module-level so that tests can lower
#: it and run the split launches in the interpreter, which has no such limit.
MAX_GRID_ROWS = 65535

#: The runtime argument of a kernel whose grid axis 1 is its rows: the first row of this launch
#: (the kernel's row is ``tl.program_id(1) + ROW_BASE``). :func:`jit_call` passes it; the launch
#: code of a template never does.
ROW_BASE = "ROW_BASE"


def _takes_row_base(kernel) -> bool:
    flag = getattr(kernel, "_fuser_row_base", None)
    if flag is None:
        flag = ROW_BASE in getattr(kernel, "arg_names", ())
        try:
            kernel._fuser_row_base = flag
        except AttributeError:  # not a JITFunction (a stand-in): ask again next time
            pass
    return flag


class _RowLaunch:
    """``launcher[grid](*args, **meta)`` for a kernel that takes :data:`ROW_BASE`: one launch
    with ``ROW_BASE=0`` when ``grid[1]`` (the rows) fits CUDA's :data:`MAX_GRID_ROWS`, else one
    launch per slice of at most that many rows, in order, each with its first row as
    ``ROW_BASE`` (so B·H above 65535 runs instead of failing with CUDA's "invalid argument").
    Symbolic rows (dynamic shapes) cannot be sliced: one launch, never a guard here; an op traced
    with symbolic sizes must rule out larger row counts in its ``symbolic`` rule (:func:`at_most`).
    ``launcher`` is the kernel, its traced stand-in or the dry run's (:func:`jit_call`)."""

    __slots__ = ("launcher",)

    def __init__(self, launcher) -> None:
        self.launcher = launcher

    def __getitem__(self, grid):
        rows = grid[1] if len(grid) > 1 else 1
        launcher = self.launcher
        # symbolic rows (an op traced with dynamic shapes): one launch, which its symbolic rule
        # (fused_op's ``symbolic``) made sure fits, with launch.at_most on its largest row count
        if not isinstance(rows, int) or rows <= MAX_GRID_ROWS:
            run = launcher[grid]
            return lambda *args, **kwargs: run(*args, ROW_BASE=0, **kwargs)

        def launch(*args, **kwargs):
            for base in range(0, rows, MAX_GRID_ROWS):
                sliced = (grid[0], min(MAX_GRID_ROWS, rows - base), *grid[2:])
                launcher[sliced](*args, ROW_BASE=base, **kwargs)

        return launch


def jit_call(kernel):
    """What a template launches ``kernel`` (a ``@triton.jit`` function) through:
    ``jit_call(kernel)[grid](*args, **meta)``.

    When the op runs: ``kernel`` itself (Triton's launcher). While the op is traced
    (:func:`tracing`): ``torch.library.wrap_triton(kernel)``, which records the launch for Inductor
    (:func:`inline_into_inductor`), after checking that every Python float argument of a
    non-constexpr parameter is cast to float32 at the kernel's entry (``x = tl.cast(x, tl.float32)``,
    the template macro ``as_fp32``):
    Inductor types such arguments float64 where Triton types them float32, and a kernel that
    does not cast them computes in float64 (a loop-carried accumulator changes type: a compile
    error). The check turns a forgotten cast into an error at trace time.

    Inside :func:`check_fit`'s dry run (:func:`launch_first_fitting`): a stand-in that checks
    the launch's shared memory against the device's instead of making or recording it.

    Rows: a kernel whose grid axis 1 runs over rows (batch × heads) takes a runtime argument
    :data:`ROW_BASE` and reads its row as ``tl.program_id(1) + ROW_BASE``; through
    :class:`_RowLaunch` a launch with more rows than CUDA's grid allows (:data:`MAX_GRID_ROWS`)
    becomes one launch per slice of rows (any of the three modes above).
    """
    check = getattr(_dry, "check", None)
    if check is not None:  # a dry run of launch_first_fitting: check the launch, do not make it
        launcher = _DryLaunch(kernel, *check)
    elif not tracing():
        launcher = kernel
    else:
        launcher = _TracedLaunch(kernel)
    return _RowLaunch(launcher) if _takes_row_base(kernel) else launcher


@contextlib.contextmanager
def launching(interpret: bool) -> Iterator[None]:
    """Context for the launches of one call of a kernel family: nothing on the GPU (templates
    launch through :func:`jit_call`); for interpreted kernels :func:`interpreter_mode`, with
    NumPy's "invalid value" and "overflow" warnings silenced (kernels compute NaN such as
    ``-inf - -inf``, or overflow such as ``finfo.min + finfo.min``, in ``tl.where`` branches that
    are never selected: free on the GPU, but NumPy reports it)."""
    if not interpret:
        yield
        return
    import numpy as np

    with interpreter_mode(), np.errstate(invalid="ignore", over="ignore"):
        yield
