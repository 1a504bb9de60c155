"""fuser's options: from ``torch.compile(..., options={...})`` and ``FUSER_*`` environment variables.

Every fuser option is spelled ``"fuser.<name>"`` in ``options=``; the same option can be set
with the environment variable ``FUSER_<NAME>`` (upper case). ``options=`` wins over the
environment. Keys that do not start with ``"fuser."`` are Inductor's and are passed on to it.

=================  ======================  ==========================================================
option             environment             meaning
=================  ======================  ==========================================================
fuser.enabled      FUSER_ENABLED           ``False``: match nothing, compile exactly as Inductor would.
fuser.patterns     FUSER_PATTERNS          patterns to fuse: a list or comma-separated string out of
                                           the implemented patterns (``attention``, ``attention_kl``,
                                           ``h2o``, ``kda``; default: all of them).
fuser.autotune     FUSER_AUTOTUNE          time candidate kernel configs (and backward plans) on the
                                           GPU on first use of each shape and cache the winner on disk.
                                           Default off; ``mode="max-autotune"`` turns it on.
fuser.plan         FUSER_PLAN              force plan choices, for tests and A/B runs: a dict or a
                                           string ``"key=value,key=value"``; keys are
                                           ``<pattern>.<choice>`` (each pattern's ``plan_choices``), e.g.
                                           ``attention.backward=atomic_dq``, ``attention.impl=inductor``
                                           (leave it to Inductor; CUDA only).
fuser.interpret    FUSER_INTERPRET         regions on CPU tensors: ``True``: fuse them, their kernels
                                           run in Triton's interpreter (slow, exact); ``False``: leave
                                           them to Inductor; ``"auto"`` (default): interpret only when
                                           ``TRITON_INTERPRET=1`` is set in the environment.
fuser.debug_dir    FUSER_DEBUG_DIR         also write every kernel rendered while compiling to this
                                           directory.
fuser.cuda_graphs  FUSER_CUDA_GRAPHS       whether the compiled graph runs replayed from CUDA graphs,
                                           for the planner's launch costs (a replayed launch costs no
                                           host time): ``"auto"`` (default) follows Inductor's
                                           ``triton.cudagraphs`` (``mode="reduce-overhead"``);
                                           ``True`` where you capture the compiled function in CUDA
                                           graphs yourself (``torch.cuda.graph``, a serving engine).
=================  ======================  ==========================================================

``FUSER_CACHE_DIR`` (environment only) sets where rendered kernels and autotuning results are
kept (default ``~/.cache/fuser``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, ClassVar, Mapping

from . import registry

#: The implemented patterns (from the registry, ``patterns/__init__.py``), in matching order.
ALL_PATTERNS = registry.names()

#: The near-miss reason for a region left to Inductor only because its tensors are on the CPU.
CPU_DECLINE = (
    "tensors are on the CPU and Triton's interpreter is off: left to Inductor; to run fuser's "
    "kernels in Triton's interpreter (slow, exact), pass options={'fuser.interpret': True} or set "
    "FUSER_INTERPRET=1"
)

_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n"}

try:  # Dynamo re-raises ShortenTraceback from a backend unchanged (torch 2.5 and later)
    from torch._dynamo.exc import ShortenTraceback as _ShortenTraceback
except Exception:  # pragma: no cover - private API moved: the error is then wrapped by Dynamo
    class _ShortenTraceback(Exception):  # type: ignore[no-redef]
        pass


class FuserOptionError(ValueError, _ShortenTraceback):
    """An option given to fuser is unknown or has a value it cannot take; the message names
    the option and the values it takes.

    A ``ValueError``. It is also a ``torch._dynamo.exc.ShortenTraceback``, which Dynamo passes
    through from a backend unchanged, so ``torch.compile(..., backend="fuser")`` raises it
    as itself at the first call. (Should a torch version wrap it all the same, it is the
    ``inner_exception`` of the ``torch._dynamo.exc.BackendCompilerFailed`` raised.)
    """

    # ShortenTraceback.remove_dynamo_frames() keeps the whole traceback when this is None.
    first_useful_frame = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        # Dynamo appends its own advice ("Set TORCHDYNAMO_VERBOSE=1 ... reporting a bug to
        # PyTorch") to the args of exceptions passing through it; the option's message is ours.
        return self.message

    def remove_dynamo_frames(self) -> "FuserOptionError":
        """The traceback from ``first_useful_frame`` on (the backend sets it to its own frame),
        as Dynamo's ShortenTraceback does; unchanged where that frame is not in it or under
        ``TORCHDYNAMO_VERBOSE=1``."""
        tb, frame = self.__traceback__, self.first_useful_frame
        try:
            from torch._dynamo import config as dynamo_config

            verbose = bool(getattr(dynamo_config, "verbose", False))
        except Exception:  # pragma: no cover
            verbose = True
        if frame is None or tb is None or verbose:
            return self
        while tb is not None and tb.tb_frame is not frame:
            tb = tb.tb_next
        return self.with_traceback(tb) if tb is not None else self


class FuserWarning(UserWarning):
    """What fuser tells the user once: a region left unfused for a reason they can change."""


def env_true(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value as Triton reads its
    own (``1``, ``true`` or ``on``, any case)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "on")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, str)):
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise FuserOptionError(f"fuser option {name!r} takes a boolean, got {value!r} (use True/False or 1/0)")


@dataclasses.dataclass(frozen=True)
class Options:
    """The resolved fuser options (see the module docstring for each).

    Attributes:
        enabled, patterns, autotune, plan, debug_dir: as the options ``fuser.<name>``.
        interpret: ``"on"``, ``"off"`` or ``"auto"`` (``fuser.interpret`` True, False, "auto").
        triton_interpret: whether ``TRITON_INTERPRET`` was set to a true value when these
            options were made (what ``interpret="auto"`` follows).
        cuda_graphs: whether the compiled graph runs replayed from CUDA graphs: the option
            ``fuser.cuda_graphs`` where it is True or False, else (``"auto"``) whether Inductor
            will (``mode="reduce-overhead"`` or ``"max-autotune"``, or Inductor's
            ``triton.cudagraphs``, in ``options=`` or its config). A kernel launch then costs no
            host time: the cost models take their launch cost from
            ``costmodel.device_model(..., cuda_graphs=True)``.
    """

    enabled: bool = True
    patterns: tuple[str, ...] = ALL_PATTERNS
    autotune: bool = False
    plan: tuple[tuple[str, str], ...] = ()
    interpret: str = "auto"  # "auto" | "on" | "off"
    debug_dir: str | None = None
    triton_interpret: bool = dataclasses.field(default_factory=lambda: env_true("TRITON_INTERPRET"))
    cuda_graphs: bool = False

    #: The near-miss reason for CPU regions when :attr:`interpret_cpu` is False.
    cpu_decline: ClassVar[str] = CPU_DECLINE

    @property
    def interpret_cpu(self) -> bool:
        """Whether regions on CPU tensors are fused, their kernels run in Triton's interpreter:
        ``fuser.interpret=True``, or ``"auto"`` with ``TRITON_INTERPRET=1`` in the environment.
        Otherwise they are left to Inductor (near-miss reason :data:`CPU_DECLINE`)."""
        if self.interpret == "auto":
            return self.triton_interpret
        return self.interpret == "on"

    def forced(self, pattern: str, choice: str) -> str | None:
        """The forced value of ``<pattern>.<choice>`` from ``fuser.plan``, if any."""
        key = f"{pattern}.{choice}"
        for k, v in self.plan:
            if k == key:
                return v
        return None


_NAMES = ("enabled", "patterns", "autotune", "plan", "interpret", "debug_dir", "cuda_graphs")


def _valid_keys() -> str:
    return ", ".join(f"{p}.{c}" for p, choices in registry.plan_choices().items() for c in choices)


def check_plan_entry(key: str, value: Any) -> tuple[str, str]:
    """Validate one ``fuser.plan`` entry against the pattern's ``plan_choices``.

    Args:
        key: ``"<pattern>.<choice>"``, e.g. ``"attention.backward"``.
        value: the forced value (a string; ``split_k`` also takes an ``int``).

    Returns:
        ``(key, value)`` with the value as a string (``split_k`` integers normalised, ``"04"``
        -> ``"4"``).

    Raises:
        FuserOptionError: the key is not ``<pattern>.<choice>``, the pattern is unknown or not
            implemented yet, the choice does not exist for the pattern (the message lists the
            valid keys), or the value is not one the choice takes (the message lists them).
    """
    if not isinstance(key, str) or "." not in key:
        raise FuserOptionError(
            f"fuser.plan key {key!r} must be '<pattern>.<choice>', e.g. 'attention.backward'; "
            f"valid keys: {_valid_keys()}"
        )
    pattern, _, choice = key.partition(".")
    if pattern in registry.planned():
        raise FuserOptionError(
            f"fuser.plan key {key!r}: the {pattern} pattern is not implemented yet, so it has no plan "
            f"choices; valid keys: {_valid_keys()}"
        )
    all_choices = registry.plan_choices()
    if pattern not in all_choices:
        raise FuserOptionError(
            f"fuser.plan key {key!r}: unknown pattern {pattern!r} (patterns with plan choices: "
            f"{', '.join(all_choices)}); valid keys: {_valid_keys()}"
        )
    choices = all_choices[pattern]
    if choice not in choices:
        raise FuserOptionError(
            f"fuser.plan key {key!r}: {pattern} has no choice {choice!r}; valid keys for {pattern}: "
            f"{', '.join(f'{pattern}.{c}' for c in choices)}"
        )
    valid = choices[choice]
    text = value if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool) and "<positive integer>" in valid:
        text = str(value)
    if text is not None:
        text = text.strip()
        if text in valid:
            return key, text
        if "<positive integer>" in valid and text.isdigit() and int(text) > 0:
            return key, str(int(text))
    raise FuserOptionError(
        f"fuser.plan {key}={value!r} is not a valid value; {key} takes one of: {', '.join(valid)}"
    )


def _parse_plan(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, str):
        items = []
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise FuserOptionError(
                    f"fuser.plan entry {part!r} is not 'key=value' (e.g. 'attention.backward=atomic_dq')"
                )
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    else:
        raise FuserOptionError(
            f"fuser.plan takes a dict or a 'key=value,key=value' string, got {value!r} "
            f"({type(value).__name__}); e.g. {{'attention.backward': 'atomic_dq'}}"
        )
    return tuple(check_plan_entry(k, v) for k, v in items)


def _parse_debug_dir(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise FuserOptionError(f"fuser.debug_dir takes a directory path, got {value!r} ({type(value).__name__})")
    path = Path(os.fspath(value)).expanduser()
    # the directory is created on first use: its nearest existing ancestor must be a directory
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        what = "is" if probe == path else f"is inside {str(probe)!r}, which is"
        raise FuserOptionError(
            f"fuser.debug_dir {str(path)!r} {what} not a directory; give a directory path (it is "
            "created if missing)"
        )
    return str(path)


def _parse(name: str, value: Any) -> Any:
    if name in ("enabled", "autotune"):
        return _as_bool(f"fuser.{name}", value)
    if name == "patterns":
        if isinstance(value, str):
            value = [p.strip() for p in value.split(",") if p.strip()]
        if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(p, str) for p in value):
            raise FuserOptionError(
                f"fuser.patterns takes a list of pattern names or a comma-separated string, got {value!r}; "
                f"known patterns: {', '.join(ALL_PATTERNS)}"
            )
        pats = tuple(p for p in ALL_PATTERNS if p in value) if isinstance(value, (set, frozenset)) else tuple(value)
        if isinstance(value, (set, frozenset)):
            pats += tuple(sorted(p for p in value if p not in ALL_PATTERNS))
        later = [p for p in pats if p in registry.planned()]
        if later:
            raise FuserOptionError(
                f"fuser.patterns: {', '.join(later)} {'is' if len(later) == 1 else 'are'} not implemented in this "
                f"version of fuser yet; implemented: {', '.join(ALL_PATTERNS)}"
            )
        bad = [p for p in pats if p not in ALL_PATTERNS]
        if bad:
            raise FuserOptionError(f"fuser.patterns: unknown pattern(s) {bad}; known: {list(ALL_PATTERNS)}")
        return pats
    if name == "plan":
        return _parse_plan(value)
    if name == "interpret":
        flag = _auto_or_bool(name, value)
        return flag if flag == "auto" else "on" if flag else "off"
    if name == "debug_dir":
        return _parse_debug_dir(value)
    if name == "cuda_graphs":
        return _auto_or_bool(name, value)
    raise AssertionError(name)


def _auto_or_bool(name: str, value: Any) -> "str | bool":
    """``"auto"`` (any case) or the boolean ``value`` stands for; FuserOptionError naming the
    three accepted values otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return _as_bool(f"fuser.{name}", value)
    except FuserOptionError:
        raise FuserOptionError(f"fuser.{name} takes True, False or 'auto', got {value!r}") from None


def resolve(options: Mapping[str, Any] | None = None, mode: str | None = None) -> tuple[Options, dict[str, Any]]:
    """Split ``torch.compile``'s ``options`` into fuser's :class:`Options` and Inductor's rest.

    Args:
        options: the ``options=`` dict given to ``torch.compile`` (may be None).
        mode: ``torch.compile``'s ``mode``; ``"max-autotune"`` modes turn fuser's autotuning on
            unless ``fuser.autotune`` says otherwise.

    Returns:
        ``(Options, inductor_options)``. Unless ``fuser.cuda_graphs`` says otherwise,
        ``Options.cuda_graphs`` is Inductor's ``triton.cudagraphs`` as the compile will see it:
        ``options=`` first, then the mode's settings, then Inductor's config.

    Raises:
        FuserOptionError: an unknown ``fuser.*`` key (the message lists the valid ones), or a
            value of the wrong kind, in ``options`` or in a ``FUSER_*`` variable.
    """
    if options is not None and not isinstance(options, Mapping):
        raise FuserOptionError(f"options must be a dict, got {type(options).__name__}")
    values: dict[str, Any] = {}
    for name in _NAMES:
        env = os.environ.get(f"FUSER_{name.upper()}")
        if env is not None and env != "":
            try:
                values[name] = _parse(name, env)
            except FuserOptionError as exc:
                raise FuserOptionError(f"environment variable FUSER_{name.upper()}={env!r}: {exc}") from None
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
    graphs = values.pop("cuda_graphs", "auto")
    return Options(**values, cuda_graphs=_cuda_graphs(rest, mode) if graphs == "auto" else graphs), rest


def _cuda_graphs(inductor_options: Mapping[str, Any], mode: str | None) -> bool:
    """Inductor's ``triton.cudagraphs`` for a compile with these options and ``mode``."""
    if "triton.cudagraphs" in inductor_options:
        return bool(inductor_options["triton.cudagraphs"])
    import torch._inductor
    from torch._inductor import config as inductor_config

    if mode is not None:  # list_mode_options(None) lists every mode's settings
        settings = torch._inductor.list_mode_options(mode)
        if "triton.cudagraphs" in settings:
            return bool(settings["triton.cudagraphs"])
    return bool(inductor_config.triton.cudagraphs)
