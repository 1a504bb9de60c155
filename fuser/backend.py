"""The ``torch.compile`` backend: ``torch.compile(model, backend="fuser")``.

Dynamo hands the backend each captured graph; fuser rewrites the regions it matches into
calls of its custom ops (``torch.ops.fuser.*``) and passes the graph to Inductor's
``compile_fx`` exactly as the default backend would — so everything it does not fuse is
compiled as under ``backend="inductor"``, forward and backward (AOTAutograd differentiates
through the custom ops' registered autograd formulas).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from . import options as options_mod
from . import passes
from .report import record

log = logging.getLogger("fuser")

_counter = {"graphs": 0}


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over fuser's Python sources and kernel templates: a new hash after any edit."""
    root = Path(__file__).resolve().parent
    from .codegen import render

    h = hashlib.sha256()
    dirs = [root, Path(render.__file__).resolve().parent]
    import fuser.patterns as pats

    dirs.append(Path(pats.__file__).resolve().parent)
    for d in dirs:
        for p in sorted(d.rglob("*.py")) + sorted(d.rglob("*.jinja")):
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _cache_key_pass(existing: Any) -> Any:
    """A no-op Inductor post-grad pass whose ``uuid()`` is :func:`source_hash`, composed with
    any pass the user already set: it puts fuser's sources into Inductor's FX-graph cache key,
    so an edit to fuser never serves stale compiled code."""
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
            parts = [f"fuser:{source_hash()}"]
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
        fuser.options.FuserOptionError: an unknown ``fuser.*`` option or a bad value.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    opts, inductor_opts = options_mod.resolve(options, mode)
    patches: dict[str, Any] = {}
    if mode is not None:
        patches.update(torch._inductor.list_mode_options(mode))
    patches.update(inductor_opts)
    if opts.debug_dir:
        import os

        os.environ["FUSER_DEBUG_DIR"] = opts.debug_dir
    index = _counter["graphs"]
    _counter["graphs"] += 1
    result = passes.apply(gm, example_inputs, opts, grad_enabled=torch.is_grad_enabled(), graph_index=index)
    record(result)
    existing = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = _cache_key_pass(existing)
    return compile_fx(gm, example_inputs, config_patches=patches)


def register() -> None:
    """Register ``"fuser"`` with Dynamo unless it is already known (installed packages are
    found through the ``torch_dynamo_backends`` entry point; registering twice fails)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "fuser" not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=fuser_backend, name="fuser")
