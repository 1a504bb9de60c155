"""The pattern registry: which patterns exist, from one place.

The list lives with the patterns, in ``fuser.patterns`` (``patterns/__init__.py``):
``PATTERN_MODULES`` maps each implemented pattern's name to its module, in matching order, and
``PLANNED`` names patterns announced but not implemented yet. Each module defines ``PATTERN``, a
:class:`fuser.pattern.Pattern` whose ``plan_choices`` are the ``fuser.plan`` keys it accepts.
The pass, the options and the reports read patterns only through this module, so adding a
pattern means adding its files under ``patterns/`` (and ``codegen/``) and one line to that list.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger("fuser")

_broken: dict[str, str] = {}


def _package():
    import fuser.patterns as patterns  # the package's __init__ only: no pattern module yet

    return patterns


def package_dir():
    """The folder of the ``fuser.patterns`` package (for hashing fuser's sources)."""
    from pathlib import Path

    return Path(_package().__file__).resolve().parent


def names() -> tuple[str, ...]:
    """The implemented patterns' names, in matching order (a region an earlier pattern takes
    is not offered to later ones)."""
    return tuple(_package().PATTERN_MODULES)


def planned() -> tuple[str, ...]:
    """Patterns announced but not implemented in this version (for error messages)."""
    return tuple(getattr(_package(), "PLANNED", ()))


def load(name: str) -> Any:
    """The ``PATTERN`` object (a :class:`fuser.pattern.Pattern`) of pattern ``name``, or None
    when its module fails to import (a broken installation: warned once, the other patterns
    still work).

    Raises:
        KeyError: ``name`` is not an implemented pattern.
    """
    module = _package().PATTERN_MODULES[name]
    if name in _broken:
        return None
    try:
        return importlib.import_module(module).PATTERN
    except Exception as exc:  # pragma: no cover - only a broken installation gets here
        _broken[name] = repr(exc)
        log.warning("fuser: pattern %s is unavailable (%r); it will not be fused", name, exc)
        return None


def enabled(pattern_names) -> list:
    """The pattern objects of ``pattern_names`` (a subset of :func:`names`), in matching order,
    skipping any whose module failed to import."""
    wanted = set(pattern_names)
    return [p for p in (load(n) for n in names() if n in wanted) if p is not None]


def plan_choices() -> dict[str, dict[str, tuple[str, ...]]]:
    """``{pattern: {choice: valid values}}`` for ``fuser.plan``, from each pattern's
    ``plan_choices`` (``"<positive integer>"`` stands for any positive integer)."""
    out = {}
    for n in names():
        p = load(n)
        if p is not None:
            out[n] = dict(p.plan_choices)
    return out


def ops_to_save() -> tuple:
    """fuser's fused forward ops, for selective activation checkpointing policies.

    A policy given to ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` is called
    with every op a checkpointed region runs; a region fuser fused runs one of these ops (an
    ``OpOverload`` such as ``torch.ops.fuser.attention.default``). Returning
    ``CheckpointPolicy.MUST_SAVE`` for them keeps their outputs (the attention output and its
    O(N) softmax statistics) for the backward instead of running the fused forward again::

        ops = fuser.ops_to_save()
        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    The list is read off ``torch.library``, not written per pattern: every op of the ``fuser``
    namespace that a pattern module (loaded through this registry: all implemented patterns,
    whichever ``fuser.patterns`` enables) defines with an autograd formula. Backward ops,
    ops of inference-only patterns (no autograd formula: nothing of them is saved for a
    backward) and the pass's own helper ops are not in it.

    Returns:
        A tuple of ``torch._ops.OpOverload``, sorted by name.
    """
    from torch._library.custom_ops import OPDEFS

    import torch

    for name in names():  # define every pattern's ops
        load(name)
    prefix = _package().__name__ + "."
    out = []
    for qualname, opdef in list(OPDEFS.items()):
        namespace, _, op = qualname.partition("::")
        module = getattr(getattr(opdef, "_init_fn", None), "__module__", "") or ""
        if namespace != "fuser" or not module.startswith(prefix) or getattr(opdef, "_backward_fn", None) is None:
            continue
        out.append(getattr(torch.ops.fuser, op).default)
    return tuple(sorted(out, key=lambda o: o.name()))
