"""Rendering templates to files, importing them, the interpreter-mode switch, and the macro file
the templates share."""

import os

import jinja2
import pytest
import torch

from fuser.codegen import attention, attention_kl, h2o, launch, render


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


def _macros(source: str) -> dict:
    """Macro name -> its definition (name, parameters, defaults, body; no line numbers)."""
    tree = render._env.parse(source)
    return {m.name: repr(m) for m in tree.find_all(jinja2.nodes.Macro)}


def test_templates_share_one_macro_file():
    # the macros more than one template needs live in render.MACRO_FILE, imported (no copies)
    shared = _macros((render.TEMPLATE_DIR / render.MACRO_FILE).read_text())
    assert {"dot", "load_mask", "mask_bias"} <= set(shared)
    kernels = sorted(render.TEMPLATE_DIR.glob("*.py.jinja"))
    families = {attention.FWD_TEMPLATE, attention.BWD_TEMPLATE, attention_kl.FWD_TEMPLATE, attention_kl.BWD_TEMPLATE,
                h2o.TEMPLATE}
    assert families <= {p.name for p in kernels}
    seen: dict[str, str] = {}  # a macro's definition -> the first template defining it
    copies = []
    for path in kernels:
        source = path.read_text()
        imports = [n for n in render._env.parse(source).find_all((jinja2.nodes.FromImport, jinja2.nodes.Import))
                   if n.template == jinja2.nodes.Const(render.MACRO_FILE)]
        assert imports, f"{path.name} does not import {render.MACRO_FILE}"
        # without context: a shared macro reads only its parameters, never the template's variables
        assert not any(n.with_context for n in imports), path.name
        own = _macros(source)
        assert not set(own) & set(shared), f"{path.name} redefines {sorted(set(own) & set(shared))}"
        for name, definition in own.items():
            if definition in seen:
                copies.append(f"{path.name} copies macro {name} of {seen[definition]}")
            seen.setdefault(definition, path.name)
    assert not copies, copies


def test_interpreter_runs_loop_bounds_given_as_arguments_with_numpy_2_4(monkeypatch):
    """Triton 3.6's interpreter reads a scalar argument used as a loop bound as ``int(array of one
    element)``, which NumPy 2.4 refuses (triton-lang/triton issue 9171; the GPU machine's torch
    2.11 / Triton 3.6 / NumPy 2.4). That Triton is simulated here on top of this one; inside
    ``interpreter_mode`` the attention kernel (its key loop bound is N_K) still runs and matches
    SDPA, and the interpreter's function is put back on exit."""
    import numpy as np
    from triton.runtime import interpreter as ti

    newer = ti._patch_lang_tensor

    def triton_3_6(tensor, scope):
        newer(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(ti, "_patch_lang_tensor", triton_3_6)
    try:
        int(np.array([3]))
        numpy_refuses = False
    except TypeError:
        numpy_refuses = True
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    o, _ = attention.forward(q, k, v, scale=0.25)
    torch.testing.assert_close(o, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25),
                               atol=1e-4, rtol=1e-4)
    assert ti._patch_lang_tensor is triton_3_6
    if numpy_refuses:  # the simulation is faithful: without the patch the same kernel fails
        monkeypatch.setattr(launch, "_patch_index_for_numpy", lambda interpreter: None)
        with pytest.raises(Exception, match="0-dimensional"):
            attention.forward(q, k, v, scale=0.25)


def test_interpreter_mode_undoes_the_interpreters_language_patch():
    # Triton 3.9's InterpretedFunction.__call__ (a jitted helper called from a kernel) patches the
    # language and never restores it; among the patches, dtype.to_ir asks the builder for unsigned
    # types that the compiler's builder lacks, so a kernel with a bool argument compiled later in
    # the process fails ("'builder' object has no attribute 'get_uint8_ty'")
    import triton.language as tl
    from triton.runtime import interpreter

    before = {obj: dict(vars(obj)) for obj in (tl, tl.core, tl.core.tensor, tl.core.dtype)}
    with launch.interpreter_mode():
        interpreter._patch_lang(tl.standard.sum.fn if hasattr(tl.standard.sum, "fn") else tl.standard.sum)
        assert tl.core.dtype.to_ir is not before[tl.core.dtype]["to_ir"]
    for obj, attrs in before.items():
        assert {k: v for k, v in vars(obj).items()} == attrs, obj
