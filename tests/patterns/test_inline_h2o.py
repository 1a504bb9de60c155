"""``torch.ops.fuser.h2o`` as Inductor sees it on the GPU (``codegen.launch.inline_into_inductor``),
checked on the CPU the way ``test_inline_ops.py`` checks the other fused ops: traced with fake
GPU tensors ("meta" standing for CUDA, an H100's config tables) through functionalisation, every
plan must become its kernel launches (``triton_kernel_wrapper_functional``) and tensor ops only —
no ``fuser.h2o`` left, no input cloned, no tensor captured from outside the call (diag_cache's
workspace and layout tables, one_kernel's zeroed score are allocated inside the traced body),
outputs with the metadata of the op's fake implementation.

What the kernels compute through this path is checked on the GPU
(``test_h2o_region_is_launched_by_inductor_on_the_gpu``, ``-m gpu``); the interpreter path (CPU
tensors, the opaque op) by ``tests/codegen/test_h2o_kernels.py`` and ``test_h2o.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.codegen import h2o as h2o_kernels
from fuser.codegen import launch
from fuser.patterns import h2o_ops

# the fake-H100 fixture and the tracing helpers of the other fused ops' inlining tests
from test_inline_ops import (GPU, _an_h100, _check_inlined, _check_inlined_symbolic, _fake_like,  # noqa: F401
                             _symbolic_fakes, _targets)

INF = float("-inf")
F32_MIN = torch.finfo(torch.float32).min
N = 150  # 3 blocks of the H100 tables' 64-wide tiles, the last ragged: diag_cache caches 1 of 3 per row

PLANS = {
    "two_kernel": "plan=two_kernel;diagonals=0;cache=balanced",
    "one_kernel": "plan=one_kernel;diagonals=0;cache=balanced",
    "diag_balanced": "plan=diag_cache;diagonals=1;cache=balanced",
    "diag_causal": "plan=diag_cache;diagonals=1;cache=causal",
}
AUTOTUNE = h2o_ops.plan_string("autotune", tries=(("two_kernel", 0, "balanced"), ("one_kernel", 0, "balanced"),
                                                  ("diag_cache", 1, "balanced")))

# (causal, mask_kind, mask, mask_fill): masks full or row-broadcast, bool and additive
VARIANTS = [
    ("none", "none", None, INF),
    ("top_left", "none", None, INF),
    ("bottom_right", "bool_keep", "row", INF),
    ("none", "bool_drop", "full", INF),
    ("top_left", "additive", "full", INF),
    ("bottom_right", "bool_keep", "row", F32_MIN),
]
VARIANT_IDS = ["plain", "causal", "br_bool_row", "bool_drop_full", "causal_additive", "bool_fill"]


def _mask(kind, mask_kind, nq=N, nk=N):
    if kind is None:
        return None
    dtype = torch.float32 if mask_kind == "additive" else torch.bool
    return torch.zeros((2, 1, 1, nk) if kind == "row" else (2, 4, nq, nk), dtype=dtype)


def _qkv(hq=4, hkv=2, nq=N, nk=N, d=16, dtype=torch.float16, strided=True):
    """q, k, v; q as a transposed view of a [B, N, H, D] buffer (Inductor passes views)."""
    q = torch.empty(2, nq, hq, d, dtype=dtype).transpose(1, 2) if strided else torch.empty(2, hq, nq, d, dtype=dtype)
    return q, torch.empty(2, hkv, nk, d, dtype=dtype), torch.empty(2, hkv, nk, d + 8, dtype=dtype)


def _args(plan, causal, mask_kind, mask, mask_fill, *, need_out=True, with_v=True, causal_fill=INF,
          causal_fill_mode="replace", nq=N, nk=N, hq=4, hkv=2):
    q, k, v = _qkv(hq, hkv, nq, nk)
    return (q, k, v if with_v else None, _mask(mask, mask_kind, nq, nk), 0.25, causal, mask_kind, need_out, plan,
            causal_fill, causal_fill_mode, mask_fill)


def _check_h2o(args):
    gm = _check_inlined(torch.ops.fuser.h2o.default, args)
    # nothing from outside the call is baked into the graph (a workspace or table kept across
    # calls would be captured as a constant: one buffer shared by every call of the compiled code)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and "tensor_constant" in str(n.target)], gm.code
    return gm


def _launched(gm):
    """The names of the kernels the traced graph launches, in order."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    names = []
    for n in gm.graph.nodes:
        if "triton_kernel_wrapper_functional" in str(n.target):
            names.append(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__)
    return names


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
@pytest.mark.parametrize("causal,mask_kind,mask,mask_fill", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("need_out", [True, False], ids=["out", "score_only"])
def test_h2o_becomes_its_kernel_launches(plan, causal, mask_kind, mask, mask_fill, need_out):
    if plan == "diag_causal" and causal == "none":
        pytest.skip("the causal layout serves causal masks (the op falls back to balanced: diag_balanced)")
    gm = _check_h2o(_args(PLANS[plan], causal, mask_kind, mask, mask_fill, need_out=need_out))
    kernels = _launched(gm)
    if plan == "one_kernel":
        assert kernels == ["h2o_fwd_kernel"], kernels
    elif plan.startswith("diag"):
        assert kernels == ["h2o_fwd_kernel", "h2o_colsum_kernel"], kernels
    else:
        # where kernel 0 is the attention forward (O wanted), with a full data mask and no causal
        # masking it first tests the mask for tiles hidden above the diagonal
        # (codegen/attention.py mask_tiles_skippable); h2o's own forward (score only) does not
        from fuser.codegen import attention

        rows = "attention_fwd_kernel" in kernels and attention.mask_skips(causal, mask_kind, mask == "row", None)
        assert kernels.count("attention_mask_rows_kernel") == int(rows), kernels
        kernels = [k for k in kernels if k != "attention_mask_rows_kernel"]
        assert kernels[-1] == "h2o_colsum_kernel" and len(kernels) == 2, kernels


def test_h2o_without_v():
    _check_h2o(_args(PLANS["two_kernel"], "top_left", "none", None, INF, need_out=True, with_v=False))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("plan", ["one_kernel", "diag_balanced"])
def test_h2o_head_groups(hq, hkv, plan):
    _check_h2o(_args(PLANS[plan], "top_left", "none", None, INF, hq=hq, hkv=hkv))


@pytest.mark.parametrize("nq,nk", [(40, 200), (200, 40)], ids=["nq<nk", "nq>nk"])
@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
def test_h2o_bottom_right_rectangles(nq, nk, plan):
    gm = _check_h2o(_args(PLANS[plan], "bottom_right", "none", None, INF, nq=nq, nk=nk))
    # Nq > Nk: the first rows see no key; eager's scores are NaN there, and so are the op's: the
    # statistics' +inf marks read in the graph (two_kernel, diag_cache) or the one_kernel variant
    # that marks them itself; Nq <= Nk: nothing to mark
    marks = any("isposinf" in str(n.target) for n in gm.graph.nodes)
    assert marks == (nq > nk and plan != "one_kernel"), gm.code


@pytest.mark.parametrize("fill,mode", [(-1e4, "replace"), (F32_MIN, "add")], ids=["replace", "add"])
@pytest.mark.parametrize("causal,mask_kind,mask", [("top_left", "none", None), ("bottom_right", "bool_keep", "row")],
                         ids=["no_mask", "bool_mask"])
def test_h2o_finite_causal_fill(fill, mode, causal, mask_kind, mask):
    # a finite causal fill runs two_kernel whatever the plan says: the attention forward with the
    # fill (and its skip flag, computed on the device inside the traced body) and the column pass
    gm = _check_h2o(_args(PLANS["diag_balanced"], causal, mask_kind, mask, INF, causal_fill=fill,
                          causal_fill_mode=mode))
    assert _launched(gm) == ["attention_fwd_kernel", "h2o_colsum_kernel"], _launched(gm)


def test_h2o_diag_cache_allocates_its_workspace_per_call():
    # the workspace holds the cached tiles between the call's two kernels: an allocation in the
    # traced graph (Inductor's, per call), never a buffer kept across calls
    h2o_kernels.clear_workspaces()
    gm = _check_h2o(_args(PLANS["diag_balanced"], "none", "none", None, INF))
    assert not h2o_kernels._workspaces and not h2o_kernels._tab_tensors  # no fake tensor kept
    fwd = [n for n in gm.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)][0]
    ws = fwd.kwargs["kwargs"]["WS"]
    assert "WS" in fwd.kwargs["tensors_to_clone"]  # written by kernel 0, read by kernel 1
    assert ws.op == "call_function" and "empty" in str(ws.target), ws.format_node()


@pytest.mark.parametrize("winner", [0, 1, 2], ids=["two_kernel", "one_kernel", "diag_cache"])
def test_h2o_autotune_takes_the_winner_while_traced(winner, monkeypatch):
    # plan=autotune under tracing times the tries on real stand-ins of the inputs (a GPU) or
    # takes the remembered winner: here a spy answers, and the traced graph runs the winner's
    # kernels; its run function, given real (CPU) stand-ins, computes the plan exactly
    seen = {}

    def spy(key, candidates, run, timer=None, inputs=None):
        seen.update(key=key, candidates=candidates, run=run, inputs=inputs)
        return candidates[winner]

    monkeypatch.setattr(launch, "autotune", spy)
    args = _args(AUTOTUNE, "top_left", "bool_keep", "row", INF)
    gm = _check_h2o(args)
    assert [c["plan"] for c in seen["candidates"]] == ["two_kernel", "one_kernel", "diag_cache"]
    fakes = seen["inputs"]
    assert fakes is not None and [tuple(x.shape) for x in fakes if x is not None] == [
        tuple(a.shape) for a in args[:4] if a is not None]
    want = {0: ["attention_fwd_kernel", "h2o_colsum_kernel"], 1: ["h2o_fwd_kernel"],
            2: ["h2o_fwd_kernel", "h2o_colsum_kernel"]}[winner]
    assert _launched(gm) == want


def test_h2o_autotune_run_computes_each_try_on_stand_ins(monkeypatch):
    # the run function autotune times takes its inputs as arguments (stand-ins under tracing):
    # each try on real CPU tensors (the interpreter) gives the float64 reference's score
    from fuser.patterns.h2o_reference import reference

    seen = {}

    def spy(key, candidates, run, timer=None, inputs=None):
        seen.update(candidates=candidates, run=run)
        return candidates[0]

    monkeypatch.setattr(launch, "autotune", spy)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    mask = torch.rand(1, 1, 1, 20, generator=g) > 0.2
    mask[..., 0] = True  # every causal row sees a key (no NaN rows)
    h2o_ops.tuned_plan(q, k, v, mask, 0.25, "top_left", "bool_keep", True,
                       [("two_kernel", 0, "balanced"), ("one_kernel", 0, "balanced"), ("diag_cache", 1, "balanced")])
    ref_out, ref_score = reference(q.double(), k.double(), v.double(), scale=0.25, causal="top_left",
                                   mask=mask, mask_kind="bool_keep")
    for cfg in seen["candidates"]:
        out, score = seen["run"](cfg, q, k, v, mask)
        torch.testing.assert_close(score.double(), ref_score, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)


def test_h2o_cpu_tensors_keep_the_opaque_op():
    args = _args(PLANS["diag_balanced"], "none", "none", None, INF)
    mode = FakeTensorMode()
    fargs = [_fake_like(mode, a, "cpu") for a in args]
    with mode:
        gm = make_fx(dispatch_functionalize(lambda *xs: torch.ops.fuser.h2o(*xs)))(*fargs)
    assert "fuser.h2o.default" in _targets(gm)


# --------------------------------------------------------------------------------------------
# GPU: Inductor's generated code launches the H2O kernels and equals eager
# --------------------------------------------------------------------------------------------


def _h2o_region(q, k, v, pad):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf")).masked_fill(~pad[:, None, None, :], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return p @ v, p.float().sum(dim=-2)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["two_kernel", "one_kernel", "diag_cache"])
def test_h2o_region_is_launched_by_inductor_on_the_gpu(plan):
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    pad = torch.ones(2, 256, dtype=torch.bool, device="cuda")
    pad[1, 200:] = False
    torch._dynamo.reset()
    compiled = torch.compile(_h2o_region, backend="fuser", options={"fuser.plan": f"h2o.plan={plan}"})
    with torch.no_grad():
        (out, score), codes = run_and_get_code(compiled, q, k, v, pad)
    code = "\n".join(codes)
    assert "torch.ops.fuser" not in code, code  # no opaque op: Inductor launches the kernels
    want = {"two_kernel": ["attention_fwd_kernel", "h2o_colsum_kernel"], "one_kernel": ["h2o_fwd_kernel"],
            "diag_cache": ["h2o_fwd_kernel", "h2o_colsum_kernel"]}[plan]
    assert all(f"def {name}" in code for name in want), code
    ref_out, ref_score = _h2o_region(q, k, v, pad)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(score, ref_score, atol=2e-3, rtol=2e-3)


def _h2o_symbolic(nq, nk, causal, mask_kind, mask, mask_fill, plan, causal_fill=INF, need_out=True, dims=(0, 2)):
    """(env, mode, fakes, fn): the h2o op on fake GPU tensors whose batch and lengths are symbolic
    (``dims`` of q, k, v; a mask's batch and length dims too), q [3, 4, Nq, 16], k [3, 2, Nk, 16],
    v [3, 2, Nk, 24]."""
    q = torch.empty(3, 4, nq, 16, dtype=torch.float16)
    k, v = torch.empty(3, 2, nk, 16, dtype=torch.float16), torch.empty(3, 2, nk, 24, dtype=torch.float16)
    m = None
    if mask is not None:
        dtype = torch.float32 if mask_kind == "additive" else torch.bool
        m = torch.zeros((3, 1, 1, nk) if mask == "row" else (3, 4, nq, nk), dtype=dtype)
    qdims = tuple(d for d in dims if d != 2 or nq > 1)  # Nq = 1 (decode) stays static, as Dynamo keeps it
    mdims = (0,) + tuple(d for d in (2, 3) if m is not None and m.shape[d] > 1)
    env, mode, fakes = _symbolic_fakes((q, k, v, m), [qdims, dims, dims, mdims])

    def fn(q, k, v, m):
        return torch.ops.fuser.h2o(q, k, v, m, 0.25, causal, mask_kind, need_out, plan, causal_fill, "add", mask_fill)

    return env, mode, fakes, fn


@pytest.mark.parametrize("nq,nk", [(1, 150), (37, 150), (150, 37), (150, 150)], ids=["decode", "nq<nk", "nq>nk", "nq=nk"])
@pytest.mark.parametrize("plan", ["two_kernel", "one_kernel"])
@pytest.mark.parametrize("causal,mask_kind,mask,mask_fill", VARIANTS, ids=VARIANT_IDS)
def test_h2o_inlines_with_symbolic_sizes(plan, causal, mask_kind, mask, mask_fill, nq, nk):
    # dynamic shapes (a KV cache growing between decode steps, a changed batch): two_kernel and
    # one_kernel choose kernels and configs from the head dims and the variant only, so the op is
    # inlined with symbolic grids, strides and offsets, without a guard beyond the rows'
    env, mode, fakes, fn = _h2o_symbolic(nq, nk, causal, mask_kind, mask, mask_fill, PLANS[plan],
                                         need_out=plan == "two_kernel")
    _check_inlined_symbolic(fn, fakes, env, mode)


@pytest.mark.parametrize("nq,nk", [(37, 150), (150, 37)])
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("plan", ["two_kernel", "diag_balanced"])
def test_h2o_finite_causal_fill_inlines_with_symbolic_sizes(plan, causal, nq, nk):
    # a finite causal fill runs two_kernel whatever the plan says (its skip flag and empty-row
    # pass decided without a guard on Nk - Nq)
    env, mode, fakes, fn = _h2o_symbolic(nq, nk, causal, "none", None, INF, PLANS[plan], causal_fill=F32_MIN)
    _check_inlined_symbolic(fn, fakes, env, mode)


@pytest.mark.parametrize("why", ["diag_cache", "autotune", "head_dim", "heads"])
def test_h2o_choices_sized_from_symbolic_sizes_stay_opaque(why):
    plan = {"diag_cache": PLANS["diag_causal"], "autotune": AUTOTUNE}.get(why, PLANS["two_kernel"])
    dims = (0, 2) + ((3,) if why == "head_dim" else ()) + ((1,) if why == "heads" else ())
    env, mode, fakes, fn = _h2o_symbolic(150, 150, "top_left", "none", None, INF, plan, dims=dims)
    with mode:
        gm = make_fx(dispatch_functionalize(fn), tracing_mode="symbolic")(*fakes)
    targets = _targets(gm)
    assert "fuser.h2o.default" in targets and not any("triton_kernel_wrapper" in t for t in targets), targets
    assert not env.replacements, env.replacements


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["two_kernel", "one_kernel"])
def test_h2o_with_dynamic_lengths_is_launched_by_inductor_on_the_gpu(plan):
    # the length marked dynamic (a new prompt length after a recompile): one graph whose kernels
    # Inductor launches serves lengths 256, 300 and 1000, each matching eager (float32 softmax)
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_h2o_region, backend="fuser", options={"fuser.plan": f"h2o.plan={plan}"})
    codes = []
    with torch.no_grad():
        for step, n in enumerate((256, 300, 1000)):
            torch.manual_seed(step)
            q, k, v = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.float16) for _ in range(3))
            pad = torch.ones(2, n, dtype=torch.bool, device="cuda")
            pad[1, n - 37:] = False
            if step == 0:
                for t, d in ((q, 2), (k, 2), (v, 2), (pad, 1)):
                    torch._dynamo.mark_dynamic(t, d)
                (out, score), got = run_and_get_code(compiled, q, k, v, pad)
                codes += got
            else:
                out, score = compiled(q, k, v, pad)
            ref_out, ref_score = _h2o_region(*(x.double() for x in (q, k, v)), pad)
            torch.testing.assert_close(out.double(), ref_out.double(), atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(score.double(), ref_score.double(), atol=2e-3, rtol=2e-3)
    code = "\n".join(codes)
    assert "torch.ops.fuser" not in code, code
    want = {"two_kernel": ["attention_fwd_kernel", "h2o_colsum_kernel"], "one_kernel": ["h2o_fwd_kernel"]}[plan]
    assert all(f"def {name}" in code for name in want), code
    assert counters["stats"]["unique_graphs"] <= 1, dict(counters["stats"])


def _h2o_bottom_right_region(q, k, v):
    # bottom-right causal (a chunk of Nq new queries against Nk cached keys): with Nq > Nk the first
    # Nq - Nk rows see no key, so eager's softmax gives NaN there and the column sums of that (b, h)
    # are NaN too
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    n_q, n_k = q.shape[-2], k.shape[-2]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(diagonal=n_k - n_q)
    p = torch.softmax(s.masked_fill(~keep, float("-inf")).float(), dim=-1)
    return p.to(q.dtype) @ v, p.sum(dim=-2)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["two_kernel", "one_kernel"])
def test_h2o_bottom_right_with_dynamic_lengths_and_empty_rows_on_the_gpu(plan):
    # Nq and Nk each their own symbol: whether Nk >= Nq (no empty row) is not known when tracing, so
    # the empty-row pass must run and give eager's NaN scores where Nq > Nk, and the exact scores
    # elsewhere; an empty row's out row is 0 where eager's is NaN (README, Limits)
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_h2o_bottom_right_region, backend="fuser",
                             options={"fuser.plan": f"h2o.plan={plan}"})
    codes = []
    with torch.no_grad():
        for step, (n_q, n_k) in enumerate(((128, 256), (300, 120), (77, 1000), (200, 200))):
            torch.manual_seed(step)
            q = torch.randn(2, 4, n_q, 64, device="cuda", dtype=torch.float16)
            k, v = (torch.randn(2, 4, n_k, 64, device="cuda", dtype=torch.float16) for _ in range(2))
            if step == 0:
                torch._dynamo.mark_dynamic(q, 2)
                for t in (k, v):
                    torch._dynamo.mark_dynamic(t, 2)
                (out, score), got = run_and_get_code(compiled, q, k, v)
                codes += got
            else:
                out, score = compiled(q, k, v)
            ref_out, ref_score = _h2o_bottom_right_region(*(x.double() for x in (q, k, v)))
            assert score.isnan().any().item() == (n_q > n_k)
            empty = ref_out.isnan().any(-1, keepdim=True)
            assert empty.sum().item() == 2 * 4 * max(n_q - n_k, 0)
            torch.testing.assert_close(out.double(), ref_out.double().masked_fill(empty, 0), atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(score.double(), ref_score.double(), atol=2e-3, rtol=2e-3, equal_nan=True)
    code = "\n".join(codes)
    assert "torch.ops.fuser" not in code, code
    assert counters["stats"]["unique_graphs"] <= 1, dict(counters["stats"])
