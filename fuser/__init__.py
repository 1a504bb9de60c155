"""fuser: a torch.compile backend that fuses attention-like subgraphs into Triton kernels.

Use ``torch.compile(model, backend="fuser")``; see the README for options and limits.

Public API:
    explain(fn_or_module, *args, **kwargs) -> Report   what was fused, why, and the kernels
    rewrite(gm, example_inputs=None, ...)              apply the pass to an FX graph (tests)
    fuser_backend                                      the backend function itself
    FuserOptionError                                   raised for bad ``fuser.*`` options
    FuserWarning                                       what fuser says once (regions left unfused)
    fuser.testing                                      pytest helpers for pattern rewrites
    fuser.names                                        readable names of graph nodes (reports)
"""

import logging as _logging
import os as _os

# In a source checkout the sub-packages fuser.patterns and fuser.codegen live beside this
# folder (the repository keeps patterns/ and codegen/ at the top level); an installed wheel
# has them inside it (see package-dir in pyproject.toml).
_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "codegen")):
    __path__.append(_os.path.dirname(_here))  # noqa: F821 - __path__ is the package's

from .backend import fuser_backend, register as _register  # noqa: E402
from .report import Report, explain  # noqa: E402
from .options import FuserOptionError, FuserWarning  # noqa: E402
from .testing import rewrite  # noqa: E402

__all__ = ["explain", "rewrite", "fuser_backend", "Report", "FuserOptionError", "FuserWarning"]
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
