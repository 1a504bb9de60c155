"""The package's shape: ``fuser`` holds exactly its own modules and the two sub-packages
``fuser.patterns`` and ``fuser.codegen`` (the repository's ``patterns/`` and ``codegen/``), each
module is loaded once, and imports only go downward (codegen <- patterns <- the pass)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fuser
import fuser.options

ROOT = Path(__file__).resolve().parents[2]


def _subpackage_folder(name: str) -> Path:
    """Where ``fuser.<name>`` should come from: inside the package folder in an installed
    wheel, beside it in a source checkout (plain or editable)."""
    here = Path(fuser.__file__).resolve().parent
    inside = here / name
    return inside if (inside / "__init__.py").is_file() else here.parent / name


@pytest.mark.parametrize("name", ["fuser.benchmarks", "fuser.tests", "fuser.fuser", "fuser.fuser.options",
                                  "fuser.examples", "fuser.docs"])
def test_only_patterns_and_codegen_join_the_package(name):
    """The repository root is not part of the package: only patterns/ and codegen/ are."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)


def test_package_paths():
    assert [Path(p).resolve() for p in fuser.__path__] == [Path(fuser.__file__).resolve().parent]
    for name in ("patterns", "codegen"):
        pkg = importlib.import_module(f"fuser.{name}")
        assert [Path(p).resolve() for p in pkg.__path__] == [_subpackage_folder(name)]
        assert getattr(fuser, name) is pkg


def test_every_module_loaded_once():
    """No source file of fuser is loaded under two names (two copies of a module would mean two
    copies of its classes and state)."""
    import fuser.codegen.attention

    assert fuser.codegen.attention is sys.modules["fuser.codegen.attention"]
    folders = [Path(fuser.__file__).resolve().parent] + [_subpackage_folder(n) for n in ("patterns", "codegen")]
    by_file: dict[Path, list[str]] = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and any(Path(f).resolve().is_relative_to(d) for d in folders):
            by_file.setdefault(Path(f).resolve(), []).append(name)
    assert by_file, "no module of fuser found in sys.modules"
    twice = {str(f): names for f, names in by_file.items() if len(names) > 1}
    assert not twice, twice
    for name, mod in sys.modules.items():
        if name.startswith(("fuser.patterns.", "fuser.codegen.")) and getattr(mod, "__file__", None):
            sub = name.split(".")[1]
            assert Path(mod.__file__).resolve().is_relative_to(_subpackage_folder(sub)), (name, mod.__file__)


def test_one_option_error_class():
    """Every module of this repository that is loaded (fuser's and the tests') sees the same
    ``FuserOptionError``."""
    mods = [m for m in list(sys.modules.values())
            if getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(ROOT)]
    mods.append(fuser.options)  # also where the package is installed outside the checkout
    classes = {id(v): v for m in mods for v in list(vars(m).values())
               if isinstance(v, type) and v.__name__ == "FuserOptionError"}
    assert list(classes.values()) == [fuser.options.FuserOptionError]
    assert fuser.FuserOptionError is fuser.options.FuserOptionError


_FRESH = textwrap.dedent("""
    import sys
    if sys.argv[1] == "no-install":  # as if fuser were not installed at all
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    import fuser.codegen.attention  # a sub-package first, before anything else of fuser
    import fuser.patterns.attention
    import fuser
    assert fuser.codegen.attention is sys.modules["fuser.codegen.attention"]
    for name in ("fuser.fuser.options", "fuser.tests", "fuser.benchmarks"):
        try:
            __import__(name)
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError(name + " was imported")
    print(fuser.__file__, fuser.patterns.__path__[0], fuser.codegen.__path__[0], sep="\\n")
""")


@pytest.mark.parametrize("mode", ["as-is", "no-install"])
def test_fresh_process_from_the_checkout(mode):
    """From the repository root, with or without whatever installation of fuser is present (an
    editable install of another checkout included), the checkout's own files are imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", _FRESH, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    init, patterns, codegen = r.stdout.split()[-3:]
    assert Path(init).resolve() == ROOT / "fuser" / "__init__.py"
    assert Path(patterns).resolve() == ROOT / "patterns"
    assert Path(codegen).resolve() == ROOT / "codegen"


# --- import direction: codegen <- patterns <- the pass --------------------------------------

# The pass driver and what sits on top of it; patterns and codegen must not reach up into them.
DRIVERS = ("fuser.passes", "fuser.backend", "fuser.report", "fuser.testing")
_IMPORTERS = {"import_module", "__import__", "find_spec"}


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module ``path`` (a module of ``package``) imports, wherever the import is
    (module top, function bodies, ``importlib.import_module``/``__import__`` with a literal
    name), as ``(line, absolute module name)``; ``from a import b`` gives both ``a`` and
    ``a.b``, and ``fuser.x`` attribute chains count as using ``fuser.x``. A call of an
    importer with a computed name gives ``(line, "?")``."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if fname in _IMPORTERS and node.args:
                arg = node.args[0]
                out.append((node.lineno, arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                            else "?"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "fuser":
            out.append((node.lineno, f"fuser.{node.attr}"))
    return out


def _sources(folder: str) -> list[Path]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no sources under {folder}/"
    return files


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder,package", [("patterns", "fuser.patterns"), ("codegen", "fuser.codegen")])
def test_patterns_and_codegen_do_not_import_the_pass(folder, package):
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _sources(folder)
           for line, name in _imports(p, package) if name == "?" or _within(name, DRIVERS)]
    assert not bad, "imports upward (or by a computed name):\n" + "\n".join(bad)


def test_codegen_knows_no_graph():
    """codegen/ is the bottom layer: of fuser it imports only its own modules (no pattern,
    no graph view, matcher, static evaluation or other part of the pass)."""
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _sources("codegen")
           for line, name in _imports(p, "fuser.codegen")
           if _within(name, ("fuser",)) and not _within(name, ("fuser.codegen",))]
    assert not bad, "codegen imports from the rest of fuser:\n" + "\n".join(bad)


def test_the_pass_reaches_patterns_only_through_the_registry():
    """fuser/ reaches the patterns only through ``fuser/registry.py`` (which reads the list in
    ``patterns/__init__.py`` and imports the modules by computed names)."""
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in _sources("fuser") if p.name != "registry.py"
           for line, name in _imports(p, "fuser") if _within(name, ("fuser.patterns",))]
    assert not bad, "fuser/ imports a pattern module directly:\n" + "\n".join(bad)


def test_import_scanner_sees_hidden_imports(tmp_path):
    """The scanner above finds function-local, relative and importlib imports."""
    src = tmp_path / "mod.py"
    src.write_text(textwrap.dedent("""
        import importlib
        from .. import passes
        def f():
            from fuser.report import explain
            importlib.import_module("fuser.backend")
            __import__(name)
            return fuser.testing
    """))
    names = [n for _, n in _imports(src, "fuser.patterns")]
    assert {"fuser.passes", "fuser.report", "fuser.backend", "?", "fuser.testing"} <= set(names)
