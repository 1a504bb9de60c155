"""fuser's options: from ``torch.compile(..., options={...})`` and ``FUSER_*`` environment variables.

Every fuser option is spelled ``"fuser.<name>"`` in ``options=``; the same option can be set
with the environment variable ``FUSER_<NAME>`` (upper case). ``options=`` wins over the
environment. Keys that do not start with ``"fuser."`` are Inductor's and are passed on to it.

=================  ======================  ==========================================================
option             environment             meaning
=================  ======================  ==========================================================
fuser.enabled      FUSER_ENABLED           ``False``: match nothing, compile exactly as Inductor would.
fuser.patterns     FUSER_PATTERNS          patterns to fuse: a list or comma-separated string out of
                                           ``attention``, ``attention_kl``, ``h2o``, ``kda``
                                           (default: every pattern this version implements).
fuser.autotune     FUSER_AUTOTUNE          time candidate kernel configs (and backward plans) on the
                                           GPU on first use of each shape and cache the winner on disk.
                                           Default off; ``mode="max-autotune"`` turns it on.
fuser.plan         FUSER_PLAN              force plan choices, for tests and A/B runs: a dict or a
                                           string ``"key=value,key=value"``; keys are
                                           ``<pattern>.<choice>``, e.g. ``attention.backward=atomic_dq``,
                                           ``attention.impl=inductor`` (decline: leave it to Inductor).
fuser.interpret    FUSER_INTERPRET         ``"auto"`` (default): regions on CPU tensors run in Triton's
                                           interpreter; ``False``: CPU regions are not fused.
fuser.debug_dir    FUSER_DEBUG_DIR         write every rendered kernel to this directory.
=================  ======================  ==========================================================

``FUSER_CACHE_DIR`` (environment only) sets where rendered kernels and autotuning results are
kept (default ``~/.cache/fuser``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

ALL_PATTERNS = ("attention", "attention_kl", "h2o", "kda")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class FuserOptionError(ValueError):
    """An option given to fuser is unknown or has a value it cannot take."""


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise FuserOptionError(f"fuser option {name!r} takes a boolean, got {value!r} (use True/False or 1/0)")


@dataclasses.dataclass(frozen=True)
class Options:
    """The resolved fuser options (see the module docstring for each)."""

    enabled: bool = True
    patterns: tuple[str, ...] = ALL_PATTERNS
    autotune: bool = False
    plan: tuple[tuple[str, str], ...] = ()
    interpret: str = "auto"  # "auto" | "off"
    debug_dir: str | None = None

    def forced(self, pattern: str, choice: str) -> str | None:
        """The forced value of ``<pattern>.<choice>`` from ``fuser.plan``, if any."""
        key = f"{pattern}.{choice}"
        for k, v in self.plan:
            if k == key:
                return v
        return None


_NAMES = tuple(f.name for f in dataclasses.fields(Options))


def _parse_plan(value: Any) -> tuple[tuple[str, str], ...]:
    if value in (None, ""):
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = []
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise FuserOptionError(
                    f"fuser.plan entry {part!r} is not 'key=value' (e.g. 'attention.backward=atomic_dq')"
                )
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    for k, _ in items:
        if "." not in k:
            raise FuserOptionError(f"fuser.plan key {k!r} must be '<pattern>.<choice>', e.g. 'attention.backward'")
    return tuple((str(k), str(v)) for k, v in items)


def _parse(name: str, value: Any) -> Any:
    if name in ("enabled", "autotune"):
        return _as_bool(f"fuser.{name}", value)
    if name == "patterns":
        if isinstance(value, str):
            value = [p.strip() for p in value.split(",") if p.strip()]
        pats = tuple(value)
        bad = [p for p in pats if p not in ALL_PATTERNS]
        if bad:
            raise FuserOptionError(f"fuser.patterns: unknown pattern(s) {bad}; known: {list(ALL_PATTERNS)}")
        return pats
    if name == "plan":
        return _parse_plan(value)
    if name == "interpret":
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return "auto" if _as_bool("fuser.interpret", value) else "off"
    if name == "debug_dir":
        return str(value) if value else None
    raise AssertionError(name)


def resolve(options: Mapping[str, Any] | None = None, mode: str | None = None) -> tuple[Options, dict[str, Any]]:
    """Split ``torch.compile``'s ``options`` into fuser's :class:`Options` and Inductor's rest.

    Args:
        options: the ``options=`` dict given to ``torch.compile`` (may be None).
        mode: ``torch.compile``'s ``mode``; ``"max-autotune"`` modes turn fuser's autotuning on
            unless ``fuser.autotune`` says otherwise.

    Returns:
        ``(Options, inductor_options)``.

    Raises:
        FuserOptionError: an unknown ``fuser.*`` key (the message lists the valid ones), or a
            value of the wrong kind, in ``options`` or in a ``FUSER_*`` variable.
    """
    values: dict[str, Any] = {}
    for name in _NAMES:
        env = os.environ.get(f"FUSER_{name.upper()}")
        if env is not None and env != "":
            values[name] = _parse(name, env)
    if mode and "max-autotune" in mode:
        values.setdefault("autotune", True)
    rest: dict[str, Any] = {}
    for key, value in (options or {}).items():
        if isinstance(key, str) and key.startswith("fuser."):
            name = key[len("fuser."):]
            if name not in _NAMES:
                valid = ", ".join(f"fuser.{n}" for n in _NAMES)
                raise FuserOptionError(f"unknown fuser option {key!r}; valid options: {valid}")
            values[name] = _parse(name, value)
        else:
            rest[key] = value
    return Options(**values), rest
