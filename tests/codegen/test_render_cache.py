"""The templates' bytecode cache (``codegen.render.TemplateBytecodeCache``): a template compiled
once is loaded from ``<FUSER_CACHE_DIR>/jinja/`` afterwards (a second process compiles no
template), an edited template is compiled afresh, and a cache that cannot be written is no
error."""

from __future__ import annotations

import os

import jinja2
import pytest

from fuser.codegen import render


def _env(folder, **options) -> jinja2.Environment:
    """An environment like ``render._env`` (its settings) over templates in ``folder``, Jinja's
    own in-memory template cache off, so that every ``get_template`` goes to the bytecode cache."""
    settings = dict(keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    settings.update(options)
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), cache_size=0,
                              bytecode_cache=render.TemplateBytecodeCache(), undefined=jinja2.StrictUndefined,
                              **settings)


def test_environments_with_other_settings_do_not_share_bytecode(tmp_path, monkeypatch):
    # Jinja keys its bytecode on the template alone: without the settings in the key, an
    # environment without trim_blocks would load the code compiled with it (and render otherwise)
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "t.jinja").write_text("{% if x %}\nyes\n{% endif %}\n")
    trimmed = _env(templates).get_template("t.jinja").render(x=1)
    plain = _env(templates, trim_blocks=False, lstrip_blocks=False).get_template("t.jinja").render(x=1)
    assert trimmed == "yes\n" and plain == "\nyes\n\n"
    assert _env(templates).get_template("t.jinja").render(x=1) == trimmed


def _compiles(monkeypatch) -> list:
    """Record every template Jinja compiles from source from now on."""
    seen: list = []
    compile_ = jinja2.Environment.compile

    def counting(self, source, name=None, filename=None, raw=False, defer_init=False):
        seen.append(name)
        return compile_(self, source, name, filename, raw, defer_init)

    monkeypatch.setattr(jinja2.Environment, "compile", counting)
    return seen


def test_a_compiled_template_is_loaded_not_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    compiled = _compiles(monkeypatch)
    env = _env(render.TEMPLATE_DIR)
    params = dict(causal=True, mask_kind="none", mask_row_broadcast=False, need_lse=True, interpret=True)
    first = env.get_template("attention_fwd.py.jinja").render(**params)
    assert "attention_fwd.py.jinja" in compiled and render.MACRO_FILE in compiled
    assert list((tmp_path / "cache" / "jinja").iterdir())  # the bytecode is on disk
    compiled.clear()
    again = _env(render.TEMPLATE_DIR).get_template("attention_fwd.py.jinja").render(**params)
    assert compiled == [] and again == first  # loaded, macros included, and the same text
    # the module's own environment uses the same cache: what it renders equals Jinja's compile
    assert isinstance(render._env.bytecode_cache, render.TemplateBytecodeCache)
    k = render.render("attention_fwd.py.jinja", "t_bc_fwd", **params)
    assert k.source == first


def test_an_edited_template_is_compiled_afresh(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "t.jinja").write_text("one {{ x }}")
    compiled = _compiles(monkeypatch)
    assert _env(templates).get_template("t.jinja").render(x=1) == "one 1"
    assert _env(templates).get_template("t.jinja").render(x=2) == "one 2"
    assert compiled == ["t.jinja"]
    (templates / "t.jinja").write_text("two {{ x }}")
    assert _env(templates).get_template("t.jinja").render(x=3) == "two 3"
    assert compiled == ["t.jinja", "t.jinja"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs a user that permissions stop")
def test_an_unwritable_cache_is_no_error(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "jinja").mkdir(parents=True)
    (tmp_path / "cache" / "kernels").mkdir()
    os.chmod(tmp_path / "cache" / "jinja", 0o500)
    try:
        templates = tmp_path / "templates"
        templates.mkdir()
        (templates / "t.jinja").write_text("{{ x }}")
        assert _env(templates).get_template("t.jinja").render(x=1) == "1"
    finally:
        os.chmod(tmp_path / "cache" / "jinja", 0o700)


def test_a_cache_path_that_is_a_file_is_no_error(tmp_path, monkeypatch):
    """(The same as an unwritable directory, for a user permissions do not stop, e.g. root.)"""
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    (tmp_path / "cache" / "jinja").write_text("not a directory")
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "t.jinja").write_text("{{ x }}")
    assert _env(templates).get_template("t.jinja").render(x=1) == "1"
    assert _env(templates).get_template("t.jinja").render(x=2) == "2"
