"""Render Jinja templates of Triton kernels to source files and import them.

Every kernel fuser runs is rendered from a template in ``codegen/templates/`` with
``jinja2.StrictUndefined`` (a missing template parameter is an error, never an empty
string), written to a content-addressed file in the kernel cache directory and imported
from there: ``@triton.jit`` reads a kernel's source through ``inspect``, so the source must
live in a real file.

Templates: one per kernel module, ``<module>.py.jinja`` (``attention_fwd.py.jinja``, ...), and
``_macros.jinja``, the macros they share (``dot``, ``load_mask``, ``mask_bias``; documented
there). Each kernel template imports the ones it uses with
``{% from "_macros.jinja" import ... %}``, without context: a shared macro reads only its
parameters. A macro that more than one template needs belongs in ``_macros.jinja``, never in a
copy per template (``tests/codegen/test_render.py`` checks). The compile cache key
(``fuser.backend.source_hash``) and :func:`template_sources` cover every ``*.jinja`` file, the
macro file included, so an edit to a shared macro is an edit to every template that uses it.

Cache directory: ``$FUSER_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/fuser`` (default
``~/.cache/fuser``); kernels go to ``<cache>/kernels/<name>_<digest>.py``, and the templates'
compiled form (Jinja's bytecode: parsing and compiling a template costs ~20-150 ms, loading
its bytecode ~1 ms) to ``<cache>/jinja/`` (:class:`TemplateBytecodeCache`), so a second process
compiles no template again. Inside
:func:`exporting_to` (the backend wraps each compile with ``fuser.debug_dir``), or with
``$FUSER_DEBUG_DIR`` set, every rendered kernel is also copied there under the same name.

Timing: inside :func:`timing` (the pass and the backend wrap each compile), the templates
rendered and the kernel modules imported are timed as the phases ``render`` and
``import kernels`` of that compile (``fuser.report.CompileTimes``); elsewhere nothing is timed.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import importlib.util
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ContextManager, Iterator, Optional

import jinja2

log = logging.getLogger("fuser")

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
# the file of the macros the kernel templates share (see the module docstring)
MACRO_FILE = "_macros.jinja"



class TemplateBytecodeCache(jinja2.FileSystemBytecodeCache):
    """Jinja's bytecode cache (``jinja2.FileSystemBytecodeCache``) in ``<cache>/jinja/``, the
    directory resolved at every use (``$FUSER_CACHE_DIR`` may change after import, e.g. in
    tests). Jinja keys each entry on the template's name and path and checks the checksum of
    its source and Jinja's and Python's bytecode versions on load, so an edited template or
    another Python is compiled afresh. A cache that cannot be read or written is skipped (the
    template is compiled, as without a cache), never an error."""

    def __init__(self) -> None:
        super().__init__(directory=os.devnull)  # never used: see _get_cache_filename

    def _get_cache_filename(self, bucket: "jinja2.bccache.Bucket") -> str:
        folder = cache_dir().parent / "jinja"
        folder.mkdir(parents=True, exist_ok=True)
        return str(folder / (self.pattern % (f"{bucket.key}-{_compile_options_digest(bucket.environment)}",)))

    def load_bytecode(self, bucket: "jinja2.bccache.Bucket") -> None:
        try:
            super().load_bytecode(bucket)
        except OSError as exc:  # e.g. an unreadable cache directory: compile the template
            log.debug("fuser: template bytecode cache not read: %s", exc)
            bucket.reset()

    def dump_bytecode(self, bucket: "jinja2.bccache.Bucket") -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError as exc:  # e.g. an unwritable cache directory: nothing is cached
            log.debug("fuser: template bytecode cache not written: %s", exc)


#: Environment settings that change the code Jinja compiles a template to (its lexer's settings,
#: the optimizer, autoescaping, extensions). Jinja's bytecode cache keys an entry on the
#: template's name and source only, so two environments with different settings sharing a cache
#: directory would load each other's code (a template rendered without ``trim_blocks`` by the
#: one that has it): the key includes these too.
_COMPILE_OPTIONS = ("block_start_string", "block_end_string", "variable_start_string", "variable_end_string",
                    "comment_start_string", "comment_end_string", "line_statement_prefix", "line_comment_prefix",
                    "trim_blocks", "lstrip_blocks", "newline_sequence", "keep_trailing_newline", "optimized",
                    "autoescape")


def _compile_options_digest(env: "jinja2.Environment") -> str:
    def name(x: Any) -> str:
        return getattr(x, "__qualname__", None) or repr(x)

    parts = [f"{k}={name(getattr(env, k, None))}" for k in _COMPILE_OPTIONS]
    parts.append("extensions=" + ",".join(sorted(env.extensions)))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    bytecode_cache=TemplateBytecodeCache(),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)

_lock = threading.Lock()
_rendered: dict[str, "RenderedKernel"] = {}
_modules: dict[str, ModuleType] = {}
# the debug directory of the compile in progress (``fuser.debug_dir``); never process-wide
_debug_dir: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("fuser_debug_dir", default=None)
# the phase timer of the compile in progress (see :func:`timing`): phase name -> context manager
_phase: contextvars.ContextVar[Optional[Callable[[str], ContextManager]]] = contextvars.ContextVar(
    "fuser_phase_timer", default=None)


@contextlib.contextmanager
def timing(phase: Optional[Callable[[str], ContextManager]]) -> Iterator[None]:
    """Inside the block, rendering (:func:`render`, when it renders) and importing
    (:func:`load_module`, when it imports) run inside ``phase("render")`` and
    ``phase("import kernels")``: the compile-time report's phases. Scoped to the current
    context, like :func:`exporting_to`."""
    token = _phase.set(phase)
    try:
        yield
    finally:
        _phase.reset(token)


def _timed(name: str) -> ContextManager:
    phase = _phase.get()
    return phase(name) if phase is not None else contextlib.nullcontext()


@contextlib.contextmanager
def exporting_to(debug_dir: Optional[str]) -> Iterator[None]:
    """Inside the block, every kernel :func:`render` returns is also copied to ``debug_dir``
    (None: only ``$FUSER_DEBUG_DIR``, if set). Scoped to the block and the current context,
    so one compile's ``fuser.debug_dir`` never reaches another's."""
    token = _debug_dir.set(debug_dir)
    try:
        yield
    finally:
        _debug_dir.reset(token)


def cache_dir() -> Path:
    """The directory rendered kernels are written to (created on first use)."""
    root = os.environ.get("FUSER_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fuser"
    path = base / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclasses.dataclass(frozen=True)
class RenderedKernel:
    """One rendered kernel module.

    Attributes:
        name: readable name, e.g. ``attention_fwd_causal``; also the file's stem prefix.
        template: template file name, e.g. ``attention_fwd.py.jinja``.
        params: the template parameters it was rendered with.
        source: the rendered Python/Triton source.
        path: where the source lies on disk.
        digest: sha256 of the source (first 16 hex digits); the file name carries it.
    """

    name: str
    template: str
    params: tuple
    source: str
    path: str
    digest: str

    def __repr__(self) -> str:  # without the source and parameters (kilobytes)
        return f"<RenderedKernel {self.name} at {self.path}>"

    @property
    def module(self) -> ModuleType:
        """The imported module (imported once per process)."""
        return load_module(self)


def _atomic_write(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def render(template: str, name: str, **params: Any) -> RenderedKernel:
    """Render ``templates/<template>`` with ``params`` and write it to the kernel cache.

    Args:
        template: the template's file name, e.g. ``"attention_fwd.py.jinja"``.
        name: a readable kernel-module name (letters, digits, ``_``).
        **params: template parameters; all must be plain values (str/int/float/bool/None
            or tuples of them) so that the rendering is reproducible.

    Returns:
        The :class:`RenderedKernel`; rendering the same template with the same
        parameters again returns the same object without touching the disk.

    Raises:
        jinja2.UndefinedError: the template uses a parameter that was not given.
        jinja2.TemplateNotFound: no such template.
    """
    key = repr((template, name, sorted(params.items())))
    with _lock:
        hit = _rendered.get(key)
    if hit is not None:
        _export_debug(hit)
        return hit
    with _timed("render"):
        source = _env.get_template(template).render(**params)
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        path = cache_dir() / f"{name}_{digest}.py"
        _atomic_write(path, source)
    kernel = RenderedKernel(
        name=name,
        template=template,
        params=tuple(sorted(params.items())),
        source=source,
        path=str(path),
        digest=digest,
    )
    with _lock:
        _rendered.setdefault(key, kernel)
        kernel = _rendered[key]
    _export_debug(kernel)
    log.debug("fuser: rendered %s -> %s", name, path)
    return kernel


def _export_debug(kernel: RenderedKernel) -> None:
    """Copy the kernel's source to the :func:`exporting_to` directory and to
    ``$FUSER_DEBUG_DIR`` (both read at every call, so kernels rendered before are exported
    too)."""
    dirs = {d for d in (_debug_dir.get(), os.environ.get("FUSER_DEBUG_DIR")) if d}
    for debug_dir in sorted(dirs):
        target = Path(debug_dir).expanduser() / Path(kernel.path).name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(target, kernel.source)


def load_module(kernel: RenderedKernel) -> ModuleType:
    """Import a rendered kernel's file as a module (once per process)."""
    with _lock:
        mod = _modules.get(kernel.digest)
        if mod is not None:
            return mod
    mod_name = f"fuser_kernels.{kernel.name}_{kernel.digest}"
    with _timed("import kernels"):
        spec = importlib.util.spec_from_file_location(mod_name, kernel.path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    with _lock:
        _modules.setdefault(kernel.digest, mod)
        return _modules[kernel.digest]


def rendered_kernels() -> list[RenderedKernel]:
    """Every kernel rendered in this process, in rendering order."""
    with _lock:
        return list(_rendered.values())


def template_sources() -> dict[str, str]:
    """Template file name -> its text, for every ``*.jinja`` file (``_macros.jinja`` included);
    used to key compile caches on template edits."""
    return {p.name: p.read_text() for p in sorted(TEMPLATE_DIR.glob("*.jinja"))}
