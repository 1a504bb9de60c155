"""Rendering templates to files, importing them, and the interpreter-mode switch."""

import os

import jinja2
import pytest
import torch

from fuser.codegen import launch, render


def test_strict_undefined_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(jinja2.UndefinedError):
        render.render("attention_fwd.py.jinja", "attention_fwd_incomplete")  # parameters missing
    k = render.render("attention_fwd.py.jinja", "t_fwd", causal=True, mask_kind="none",
                      mask_row_broadcast=False, need_lse=True, interpret=True)
    assert k.path.startswith(str(tmp_path / "cache")) and os.path.exists(k.path)
    assert k.digest in os.path.basename(k.path) and "@triton.jit" in k.source
    again = render.render("attention_fwd.py.jinja", "t_fwd", causal=True, mask_kind="none",
                          mask_row_broadcast=False, need_lse=True, interpret=True)
    assert again is k
    mod = launch.kernel_module(k, interpret=True)
    assert hasattr(mod, "attention_fwd_kernel")


def test_debug_dir_gets_kernels_rendered_earlier(tmp_path, monkeypatch):
    k = render.render("attention_bwd.py.jinja", "t_bwd", causal=False, mask_kind="additive",
                      mask_row_broadcast=True, atomic_dq=True, interpret=True)
    monkeypatch.setenv("FUSER_DEBUG_DIR", str(tmp_path / "dbg"))
    render.render("attention_bwd.py.jinja", "t_bwd", causal=False, mask_kind="additive",
                  mask_row_broadcast=True, atomic_dq=True, interpret=True)
    assert (tmp_path / "dbg" / os.path.basename(k.path)).read_text() == k.source


def test_interpreter_mode_restores_triton_stdlib():
    import triton.language as tl

    before = tl.sum
    with launch.interpreter_mode():
        assert os.environ["TRITON_INTERPRET"] == "1"
        inside = tl.sum
    assert tl.sum is before
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(inside, InterpretedFunction)


def test_poisoned_outputs():
    with launch.poison_outputs():
        x = launch.empty((3,), torch.float32, "cpu")
    assert torch.isnan(x).all()


def test_dot_precision_follows_torch(monkeypatch):
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert launch.dot_precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert launch.dot_precision(torch.float32) == "tf32"
        assert launch.dot_precision(torch.bfloat16) == "ieee"
    finally:
        torch.set_float32_matmul_precision(old)
