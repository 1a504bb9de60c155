"""Shared pytest setup.

- Tests marked ``gpu`` are skipped where no CUDA device is present.
- The suite asks for Triton's interpreter on CPU tensors (``FUSER_INTERPRET=1``; a CPU region
  is otherwise left to Inductor). ``TRITON_INTERPRET`` is left alone: on a GPU machine it would
  turn every Triton kernel, Inductor's too, into interpreted ones.
- Rendered kernels and autotuning results go to a temporary ``FUSER_CACHE_DIR`` for the whole
  session (subprocesses inherit it), never to the user's ``~/.cache/fuser``: an audit hook
  records any write there by this process, and the session fails if there was one.
- Subprocesses import the fuser of this checkout (``PYTHONPATH``), not whichever is installed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parent.parent)


def _real_cache_dir() -> str:
    """Where fuser would keep its cache without the suite's override (as codegen.render does)."""
    root = os.environ.get("FUSER_CACHE_DIR")
    if root:
        return os.path.realpath(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.realpath(os.path.join(base, "fuser"))


REAL_CACHE_DIR = _real_cache_dir()
SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="fuser-test-cache-")
os.environ["FUSER_CACHE_DIR"] = SESSION_CACHE_DIR
os.environ["FUSER_INTERPRET"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

_writes_to_real_cache: list[str] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and bool(flags & _WRITE_FLAGS))
        if not writing:
            return
    elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.copyfile"):
        path = args[0] if args else None
    else:
        return
    if isinstance(path, (str, bytes, os.PathLike)):
        p = os.fsdecode(os.fspath(path))
        full = os.path.realpath(p) if os.path.isabs(p) else os.path.realpath(os.path.join(os.getcwd(), p))
        if full == REAL_CACHE_DIR or full.startswith(REAL_CACHE_DIR + os.sep):
            _writes_to_real_cache.append(f"{event} {full}")


sys.addaudithook(_audit)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    if _writes_to_real_cache:
        shown = "\n  ".join(_writes_to_real_cache[:10])
        sys.stderr.write(f"\nERROR: the test session wrote to the user's fuser cache {REAL_CACHE_DIR} "
                         f"(tests must use FUSER_CACHE_DIR={SESSION_CACHE_DIR}):\n  {shown}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)
