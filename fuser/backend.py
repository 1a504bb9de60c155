"""The ``torch.compile`` backend: ``torch.compile(model, backend="fuser")``.

Dynamo hands the backend each captured graph; fuser rewrites the regions it matches into
calls of its custom ops (``torch.ops.fuser.*``) and passes the graph to Inductor's
``compile_fx`` exactly as the default backend would — so everything it does not fuse is
compiled as under ``backend="inductor"``, forward and backward (AOTAutograd differentiates
through the custom ops' registered autograd formulas).

Per compiled graph the ``fuser`` logger says at INFO where fuser's own compile time went
(``fuser: compile phases, graph 0 (ms): canonicalise 1.2, ..., total 33.0; Inductor's
compile_fx ...``; :class:`fuser.report.CompileTimes`, also in ``explain()``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from . import options as options_mod
from . import passes, registry
from .codegen import launch, render
from .options import FuserOptionError, FuserWarning
from .report import PhaseTimer, next_graph_index, record

log = logging.getLogger("fuser")

# What has been said once in this process (see _tell): "cpu", and internal-error messages.
_said: set[str] = set()
_said_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over fuser's Python sources and kernel templates: a new hash after any edit."""
    h = hashlib.sha256()
    dirs = [Path(__file__).resolve().parent, Path(render.__file__).resolve().parent, registry.package_dir()]
    for d in dirs:
        for p in sorted(d.rglob("*.py")) + sorted(d.rglob("*.jinja")):
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _cache_key_pass(existing: Any) -> Any:
    """A no-op Inductor post-grad pass whose ``uuid()`` is :func:`source_hash` (and whether fused
    ops are inlined into Inductor, ``codegen.launch.INLINE_INTO_INDUCTOR``), composed with any
    pass the user already set: it puts fuser's sources into Inductor's FX-graph cache key, so an
    edit to fuser never serves stale compiled code."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    # torch 2.11 takes one pass per hook, 2.13 also a list or tuple: accept both.
    if existing is None:
        inner: tuple = ()
    elif isinstance(existing, (list, tuple)):
        inner = tuple(existing)
    else:
        inner = (existing,)

    class FuserCacheKey(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for p in inner:
                p(graph)

        def uuid(self) -> Any:
            parts = [f"fuser:{source_hash()}", f"inline:{int(launch.INLINE_INTO_INDUCTOR)}"]
            for p in inner:
                u = p.uuid() if hasattr(p, "uuid") else None
                if u is None:
                    return None  # an uncacheable user pass keeps the graph uncacheable
                parts.append(repr(u))
            return "|".join(parts)

    return FuserCacheKey()


def fuser_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: Optional[str] = None,
    options: Optional[dict] = None,
) -> Callable:
    """The backend function ``torch.compile`` calls for every captured graph.

    Args:
        gm: Dynamo's graph.
        example_inputs: its example inputs (tensors, SymInts).
        mode: ``torch.compile``'s ``mode`` (turned into Inductor settings as Inductor does; the
            ``max-autotune`` modes also turn on fuser's autotuning).
        options: ``torch.compile``'s ``options``: ``fuser.*`` keys are fuser's (see
            :mod:`fuser.options`), the rest go to Inductor.

    Returns:
        The compiled callable from ``torch._inductor.compile_fx.compile_fx``.

    Raises:
        fuser.options.FuserOptionError: an unknown ``fuser.*`` option or a bad value, or a
            ``fuser.plan`` value a match does not offer. Dynamo lets it through as itself (it
            is a ``torch._dynamo.exc.ShortenTraceback``); a torch that wraps it all the same
            raises ``torch._dynamo.exc.BackendCompilerFailed`` with it as ``inner_exception``.

    Warns:
        fuser.options.FuserWarning: once per process when regions on CPU tensors were left to
            Inductor because Triton's interpreter was not asked for, and once per distinct
            internal error that left a region unfused.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    try:
        opts, inductor_opts = options_mod.resolve(options, mode)
        index = next_graph_index()
        if compiled_autograd_graph():
            # the backward graph compiled autograd traced: AOTAutograd's backward graphs (fuser's
            # backward ops in them already) and the autograd engine's own ops; it passes as it is
            log.info("fuser: graph %d is compiled autograd's backward graph: passed to Inductor untouched", index)
            result = passes.PassResult()
        else:
            with render.exporting_to(opts.debug_dir):
                result = passes.apply(gm, example_inputs, opts, grad_enabled=torch.is_grad_enabled(),
                                      graph_index=index)
    except FuserOptionError as exc:
        # Dynamo passes a ShortenTraceback through unchanged and cuts the traceback to start here
        exc.first_useful_frame = inspect.currentframe()
        raise
    _tell(result, opts)
    if launch.PREFETCH and any(m.fused for m in result.matches):
        t0 = time.perf_counter()
        try:
            started = prefetch_kernel_compiles(gm, example_inputs, grad=torch.is_grad_enabled())
        except Exception as exc:  # noqa: BLE001 - only a head start: Inductor's trace compiles what is missing
            log.debug("fuser: prefetching kernel compiles failed (%s: %s)", type(exc).__name__, exc)
            started = 0
        if started and result.times is not None:
            result.times.phases["prefetch"] = (time.perf_counter() - t0) * 1e3
    record(result, opts)
    patches: dict[str, Any] = {}
    if mode is not None:
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(inductor_opts)
    existing = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = _cache_key_pass(existing)
    return _compile_timed(compile_fx, gm, example_inputs, patches, result.times, opts.enabled)


def prefetch_kernel_compiles(gm: fx.GraphModule, example_inputs: Sequence[Any] = (), *, grad: bool) -> int:
    """Start, in the background, the compiles of the kernels that tracing the fused ops of
    ``gm`` for Inductor will check (:func:`fuser.codegen.launch.prefetch_compiles`, with each
    call's arguments as the graph's example values, ``meta["val"]`` or Dynamo's
    ``meta["example_value"]``): AOTAutograd's trace then waits on compiles
    started together (forward and backward kernels, every fused op of the graph) instead of
    making them one after another. Returns how many calls were traced so; a call whose arguments
    lack example values is skipped. A placeholder without one (the pieces DDPOptimizer splits
    off) takes its entry of ``example_inputs``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    given = dict(zip(placeholders, example_inputs)) if len(placeholders) == len(example_inputs) else {}
    started, seen = 0, set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not launch.is_fused_op(node.target):
            continue
        missing = []

        def val(a):
            if isinstance(a, fx.Node):
                v = a.meta.get("val", a.meta.get("example_value", given.get(a)))  # AOT's / Dynamo's / given
                if v is None:
                    missing.append(a)
                return v
            return a

        args, kwargs = fx.node.map_aggregate(node.args, val), fx.node.map_aggregate(node.kwargs, val)
        if missing:
            continue
        key = _call_key(node.target, args, kwargs)
        if key is not None and key in seen:  # the same call again (every layer's): the same compiles
            continue
        seen.add(key)
        if launch.prefetch_compiles(node.target, args, dict(kwargs), grad=grad):
            started += 1
    return started


def _call_key(target, args, kwargs) -> "tuple | None":
    """What decides a fused call's kernels and their launches: the op, each tensor's sizes,
    strides, dtype, device and ``requires_grad``, every other argument's repr (None when a
    size is symbolic: such calls are not prefetched)."""
    parts: list = [str(target)]
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor):
            if any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride())):
                return None
            parts.append((tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device), x.requires_grad))
        else:
            parts.append(repr(x))
    return tuple(parts)


def compiled_autograd_graph() -> bool:
    """Whether the graph being compiled now is one that compiled autograd traced from a
    backward pass (``torch._dynamo.config.compiled_autograd = True``, or
    ``torch._dynamo.compiled_autograd._enable``): Dynamo compiles it with the compile id's
    ``compiled_autograd_id`` set, while compiled autograd's runtime wrapper runs. Such a graph
    is made of AOTAutograd's backward graphs (with fuser's backward ops where the forward was
    fused, and the forward ops that activation checkpointing recomputes) and the autograd
    engine's own ops: fuser leaves it as it is."""
    from torch._guards import CompileContext

    try:
        cid = CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - private API moved: fall back on the region flag
        cid = None
    if cid is not None and hasattr(cid, "compiled_autograd_id"):
        return cid.compiled_autograd_id is not None
    from torch._dynamo import compiled_autograd

    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


def _compile_timed(compile_fx: Callable, gm: fx.GraphModule, example_inputs: Sequence[Any], patches: dict,
                   times: Any, enabled: bool) -> Callable:
    """``compile_fx`` with its time added to ``times`` (:class:`fuser.report.CompileTimes`):
    fuser's phases that run inside it (kernel modules imported while it traces the graph) go
    to those phases, the rest is Inductor's; then the graph's compile-time line at INFO."""
    if times is None:
        return compile_fx(gm, example_inputs, config_patches=patches)
    timer = PhaseTimer()
    t0 = time.perf_counter()
    try:
        with render.timing(timer.phase):
            return compile_fx(gm, example_inputs, config_patches=patches)
    finally:
        nested = sum(timer.ms.values())
        for name, ms in timer.ms.items():
            times.phases[name] = times.phases.get(name, 0.0) + ms
        times.inductor_ms = (time.perf_counter() - t0) * 1e3 - nested
        if enabled:
            log.info("fuser: compile phases, graph %d (ms): %s", times.graph_index, times.text())


def _say_once(key: str, message: str) -> None:
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    warnings.warn(message, FuserWarning, stacklevel=2)


def _tell(result: Any, opts: options_mod.Options) -> None:
    """Warn (once per process, per message) about regions left unfused for a reason the user
    would want to know: CPU tensors without the interpreter (only under the default
    ``fuser.interpret="auto"``: whoever set it to False asked for this), and internal errors
    while matching or emitting a kernel (e.g. an unwritable kernel cache)."""
    cpu = [r for r in result.rejected if opts.cpu_decline in r.reason]
    if cpu and opts.interpret == "auto":
        where = ", ".join(sorted({r.location for r in cpu})[:3])
        _say_once("cpu", (
            f"fuser: {len(cpu)} region(s) on CPU tensors ({where}) were left to Inductor: fuser's Triton "
            "kernels run on CPU tensors only in Triton's interpreter, which is slow (seconds per call; "
            "meant for trying fuser out and for tests). To fuse them anyway, pass "
            "options={'fuser.interpret': True} to torch.compile, or set FUSER_INTERPRET=1 (or "
            "TRITON_INTERPRET=1). Said once per process."
        ))
    for r in result.rejected:
        if r.reason.startswith("internal error"):
            _say_once(f"internal:{r.pattern}:{r.reason}", (
                f"fuser: {r.pattern} at {r.location} was not fused because of an internal error and "
                f"runs as Inductor compiles it: {r.reason}. TORCH_LOGS=+fuser shows details; please "
                "report it if the cause is not in your setup (e.g. an unwritable FUSER_CACHE_DIR)."
            ))


def register() -> None:
    """Register ``"fuser"`` with Dynamo unless it is already known (installed packages are
    found through the ``torch_dynamo_backends`` entry point; registering twice fails), and load
    Inductor's compile stack.

    Every graph fuser gets ends in Inductor's ``compile_fx``. ``torch.compile(model)`` with the
    default backend imports that stack when it is called (about 1,500 modules, ~180 of them
    Inductor's: 2.2 s on a 2-core CPU, measured), so its first call only compiles; without this
    import the same modules would load inside fuser's first call (259 modules in the cProfile of
    the warm-cache Llama training step on the H100, most of that first call's 1.64× gap to
    Inductor's; 268 for a toy model on the CPU). Importing ``fuser`` (or Dynamo resolving
    ``backend="fuser"`` through the entry point, which imports this module) therefore loads it up
    front: the same modules load either way, and the first call does compile work only, as
    Inductor's does (``benchmarks/results/compile_time.md``: 1.08× cold, 1.04× warm after).
    """
    from torch._dynamo.backends.registry import list_backends, register_backend
    import torch._inductor.compile_fx  # noqa: F401  (see above)

    if "fuser" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=fuser_backend, name="fuser")
