"""fuser: a torch.compile backend that fuses attention-like subgraphs into Triton kernels.

Use ``torch.compile(model, backend="fuser")``; see the README for options and limits.

Public API:
    explain(fn_or_module, *args, **kwargs) -> Report   what was fused, why, and the kernels
    rewrite(gm, example_inputs=None, ...)              apply the pass to an FX graph (tests)
    fuser_backend                                      the backend function itself
    ops_to_save()                                      fuser's fused forward ops (selective-AC policies)
    FuserOptionError                                   raised for bad ``fuser.*`` options
    FuserWarning                                       what fuser says once (regions left unfused)
    fuser.testing                                      pytest helpers for pattern rewrites
    fuser.names                                        readable names of graph nodes (reports)
"""

import importlib.util as _importlib_util
import logging as _logging
import os as _os
import sys as _sys


def _map_subpackages() -> None:
    """Make ``fuser.patterns`` and ``fuser.codegen`` the repository's ``patterns/`` and
    ``codegen/`` folders when this package is used from a source checkout.

    An installed wheel holds both inside this folder (see package-dir in pyproject.toml) and
    needs nothing here. In a checkout they sit beside it; each is registered by hand, once,
    as a package whose submodules are searched in its own folder, and nothing else of the
    repository root becomes part of ``fuser`` (``fuser.tests``, ``fuser.benchmarks`` and
    ``fuser.fuser`` do not exist). This runs before anything imports from either
    sub-package, so that an editable install's finder, which maps the same two names to the
    same folders, never loads a second copy; and a checkout used without installation wins
    over an editable install of another checkout.
    """
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    for name in ("patterns", "codegen"):
        full = f"{__name__}.{name}"
        folder = _os.path.join(root, name)
        init = _os.path.join(folder, "__init__.py")
        if full in _sys.modules or _os.path.isfile(_os.path.join(here, name, "__init__.py")) \
                or not _os.path.isfile(init):
            continue
        spec = _importlib_util.spec_from_file_location(full, init, submodule_search_locations=[folder])
        module = _importlib_util.module_from_spec(spec)
        _sys.modules[full] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del _sys.modules[full]
            raise
        globals()[name] = module


_map_subpackages()

from .backend import fuser_backend, register as _register  # noqa: E402
from .report import Report, explain  # noqa: E402
from .options import FuserOptionError, FuserWarning  # noqa: E402
from .testing import rewrite  # noqa: E402
from .exporting import export  # noqa: E402
from .registry import ops_to_save  # noqa: E402

__all__ = ["explain", "rewrite", "export", "fuser_backend", "Report", "FuserOptionError", "FuserWarning", "ops_to_save"]
__version__ = "0.1.0"

_logging.getLogger("fuser").addHandler(_logging.NullHandler())
try:  # TORCH_LOGS="fuser" (INFO) / "+fuser" (DEBUG)
    from torch._logging._internal import register_log as _register_log

    _register_log("fuser", "fuser")
except Exception:  # pragma: no cover - private API moved
    pass

_register()
# Import every pattern module now, so their ops (torch.ops.fuser.*) exist before any graph that
# calls them is loaded (e.g. from Inductor's cache in a fresh process).
from .passes import load_patterns as _load_patterns  # noqa: E402
from .options import Options as _Options  # noqa: E402

_load_patterns(_Options())
