"""The fused ops as Inductor sees them on the GPU (``codegen.launch.inline_into_inductor``),
checked on the CPU: each op is traced with fake GPU tensors through functionalisation (what
AOTAutograd does before Inductor), and must become the launches of its kernels
(``triton_kernel_wrapper_functional`` nodes) and tensor ops only — no opaque ``fuser.*`` op
left, nothing run, no data-dependent Python, every float argument cast to float32 at its
kernel's entry (``launch.jit_call``), and outputs with the shapes, strides and dtypes the op's
fake implementation promised Dynamo. CPU tensors keep the opaque op (the interpreter).

The kernels' results on the GPU through this path: the GPU tests that compile with
``backend="fuser"`` (``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.codegen import launch

INF = float("-inf")
ATTN_PLAN = "backward=two_kernel;autotune=0"
KL_PLAN = "split_k=1;backward=two_kernel"
F32_MIN = torch.finfo(torch.float32).min
WINDOW = "and(ge(1,-1,0),ge(-1,1,1))"


#: What the GPU's tensors are here: "meta" tensors stand for CUDA ones, inlined as CUDA calls are
#: (``launch.INLINE_DEVICE_TYPES``): on a CPU-only torch, fake CUDA tensors cannot ``copy_``.
GPU = "meta"


@pytest.fixture(autouse=True)
def _an_h100(monkeypatch, request):
    """Config tables key on the device: answer as an H100 would, with no GPU here. Not for
    tests marked ``gpu`` (in modules that import this fixture): they compile and run on the
    real device."""
    if request.node.get_closest_marker("gpu") is not None:
        return
    monkeypatch.setattr(launch, "device_properties",
                        lambda index: {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": (9, 0)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", True)
    monkeypatch.setattr(launch, "INLINE_DEVICE_TYPES", ("cuda", GPU))
    # Inductor's analysis of which arguments a kernel writes compiles it to TTIR for the current
    # target: name an H100 (nothing is compiled further, nothing runs)
    import triton
    from triton.backends.compiler import GPUTarget

    class _H100Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", _H100Driver())


def _fake_like(mode, x, device=GPU):
    if not isinstance(x, torch.Tensor):
        return x
    with mode:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)


def _trace(op, args, device=GPU):
    """(graph module, fake outputs of the traced body, fake outputs of the op's fake impl)."""
    mode = FakeTensorMode()
    fargs = [_fake_like(mode, a, device) if not isinstance(a, list) else a for a in args]
    with mode:
        gm = make_fx(dispatch_functionalize(lambda *xs: op(*xs)))(*fargs)
        expect = op(*fargs)  # dispatches to the fake implementation under FakeTensorMode
        got = gm(*fargs)
    return gm, got, expect


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _check_inlined(op, args):
    gm, got, expect = _trace(op, args)
    targets = _targets(gm)
    assert any("triton_kernel_wrapper_functional" in t for t in targets), targets
    assert not any(t.startswith("fuser.") for t in targets), targets
    # Inductor's analysis of the kernels finds they write only buffers the op allocated: no
    # input is copied to protect it from a kernel's writes
    for node in gm.graph.nodes:
        if "triton_kernel_wrapper_functional" in str(node.target):
            written = [node.kwargs["kwargs"][name] for name in node.kwargs["tensors_to_clone"]]
            assert not [w for w in written if isinstance(w, torch.fx.Node) and w.op == "placeholder"], node.kwargs
    _analysed_as_older_torch(gm)
    # and no kernel writes a slice of a buffer another reads, which functionalisation scatters
    # back into the whole (a KDA workspace sliced into parts once cost six copy kernels a call)
    scatters = [t for t in targets if "scatter" in t]
    assert not scatters, scatters
    for g, e in zip(got, expect):
        assert (g.shape, g.dtype) == (e.shape, e.dtype)
        if e.numel() > 1:
            assert g.stride() == e.stride(), (g.shape, g.stride(), e.stride())
    return gm


def _analysed_as_older_torch(gm):
    """Every kernel the traced graph launches lowers to TTIR as torch 2.11's access analysis
    lowers it: each non-tensor argument a constant (a Python number in the kernel), not a scalar
    of the kernel's signature (torch 2.13 passes only ``tl.constexpr`` ones so). A kernel that
    calls ``.to()`` on such an argument fails there; torch then assumes the kernel writes every
    tensor it takes, so Inductor copies the op's inputs before each call and skips CUDA graphs
    ("mutated inputs"): seen on the H100 with torch 2.11 (the attention-KL forward's ``SPLIT_K``).
    """
    import copy

    from torch._higher_order_ops import triton_kernel_wrap as tkw
    from triton.runtime.autotuner import Autotuner

    for node in gm.graph.nodes:
        if "triton_kernel_wrapper_functional" not in str(node.target):
            continue
        kernel = tkw.kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        kwargs = {k: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for k, v in node.kwargs["kwargs"].items()}
        kwargs.update(tkw.kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
        if isinstance(kernel, Autotuner):
            kwargs.update(kernel.configs[0].kwargs if kernel.configs else {})
            kernel = kernel.fn
        older = copy.copy(kernel)
        older.params = [copy.copy(p) for p in kernel.params]
        for p in older.params:
            if not isinstance(kwargs.get(p.name), torch.Tensor):
                p.__dict__["is_constexpr"] = True  # a cached property of Triton's KernelParam
                p.do_not_specialize = p.do_not_specialize_on_alignment = False
        older.do_not_specialize = []
        if hasattr(older, "do_not_specialize_on_alignment"):
            older.do_not_specialize_on_alignment = []
        try:
            tkw.generate_ttir(older, kwargs, node.kwargs.get("tma_descriptor_metadata") or {})
        except Exception as e:  # noqa: BLE001 -- the failure is the finding
            raise AssertionError(f"{kernel.fn.__name__} does not lower with its scalar arguments as "
                                 f"constants (torch 2.11's access analysis): {str(e)[-600:]}") from None


def _qkv(hq=4, hkv=2, n=40, d=16, dtype=torch.float16):
    return [torch.empty(2, h, n, d, dtype=dtype) for h in (hq, hkv, hkv)]


ATTN_VARIANTS = [
    ("none", "none", None, (INF, INF, "replace", "", [], INF, "replace")),
    ("top_left", "none", None, (INF, INF, "replace", "", [], INF, "replace")),
    ("bottom_right", "bool_keep", "bool", (-1e4, F32_MIN, "add", "", [], INF, "replace")),
    ("none", "additive", "float", (INF, INF, "replace", "", [], INF, "replace")),
    ("none", "bool_keep", "bool", (-2.0, INF, "replace", "or(ge(1,-1,0),ge(0,-1,1))", [0, 3], F32_MIN, "add")),
    ("none", "none", None, (INF, INF, "replace", WINDOW, [2, 7], -1.5, "replace")),
]
ATTN_IDS = ["plain", "causal", "bool_fills", "additive", "pred_fill_mask", "window_fill"]


def _mask(kind, n=40):
    if kind == "bool":
        return torch.zeros(2, 1, 1, n, dtype=torch.bool)
    if kind == "float":
        return torch.zeros(2, 1, n, n)
    return None


@pytest.mark.parametrize("need_lse", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("causal,mask_kind,mask,fills", ATTN_VARIANTS, ids=ATTN_IDS)
def test_attention_forward_becomes_its_kernel_launch(causal, mask_kind, mask, fills, need_lse):
    q, k, v = _qkv()
    _check_inlined(torch.ops.fuser.attention.default,
                   (q, k, v, _mask(mask), 0.25, causal, mask_kind, need_lse, ATTN_PLAN, *fills))


@pytest.mark.parametrize("mode", ["two_kernel", "atomic_dq"])
@pytest.mark.parametrize("causal,mask_kind,mask,fills", ATTN_VARIANTS, ids=ATTN_IDS)
def test_attention_backward_becomes_its_kernel_launches(causal, mask_kind, mask, fills, mode):
    q, k, v = _qkv()
    two_part = mask_kind == "additive" or fills[:2] != (INF, INF) or fills[5] != INF
    lse = torch.empty(2, 4, 2, 40) if two_part else torch.empty(2, 4, 40)
    out = torch.empty(2, 40, 4, 16, dtype=q.dtype).transpose(1, 2)
    _check_inlined(torch.ops.fuser.attention_backward.default,
                   (torch.empty_like(out), q, k, v, out, lse, _mask(mask), 0.25, causal, mask_kind,
                    f"backward={mode};autotune=0", [True, True, True], *fills))


def test_more_rows_than_a_grid_holds_become_one_launch_per_slice(monkeypatch):
    # B·Hq = 8 rows, 3 a grid (CUDA's 65535, lowered): the traced forward records three launches of
    # the same kernel, ROW_BASE 0, 3, 6, each with a grid of at most 3 rows
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    monkeypatch.setattr(launch, "MAX_GRID_ROWS", 3)
    q, k, v = _qkv()
    gm = _check_inlined(torch.ops.fuser.attention.default,
                        (q, k, v, None, 0.25, "top_left", "none", True, ATTN_PLAN, INF, INF, "replace", "", [], INF,
                         "replace"))
    calls = []
    for n in gm.graph.nodes:
        if "triton_kernel_wrapper_functional" in str(n.target):
            const = kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])
            calls.append((n.kwargs["grid"][0][1], const.get("ROW_BASE", n.kwargs["kwargs"].get("ROW_BASE"))))
    assert calls == [(3, 0), (3, 3), (2, 6)], calls


KL_FILLS = [(INF, INF, INF, INF, "replace", False), (-1e4, F32_MIN, -2.0, -3.0, "add", False),
            (-1e4, F32_MIN, -2.0, -3.0, "add", True)]


@pytest.mark.parametrize("split_k", ["1", "2"])
@pytest.mark.parametrize("fills", KL_FILLS, ids=["hide", "fills", "zero_hidden"])
def test_attention_kl_forward_becomes_its_kernel_launches(fills, split_k):
    # 300 keys: several key tiles, so split_k=2 splits them (then a merge kernel runs)
    q1, k1, q2, k2 = (torch.empty(2, h, 300, d, dtype=torch.float16) for h, d in ((4, 16), (1, 16), (4, 24), (2, 24)))
    gm = _check_inlined(torch.ops.fuser.attention_kl.default,
                        (q1, k1, q2, k2, _mask("bool", 300), 0.25, 0.2, "bottom_right", "bool_drop", True,
                         f"split_k={split_k};backward=two_kernel", *fills))
    merges = [n for n in gm.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)
              and "merge" in torch._higher_order_ops.triton_kernel_wrap.kernel_side_table.get_kernel(
                  n.kwargs["kernel_idx"]).fn.__name__]
    assert len(merges) == (split_k == "2"), gm.code


@pytest.mark.parametrize("mode", ["two_kernel", "atomic_dq"])
@pytest.mark.parametrize("fills", KL_FILLS, ids=["hide", "fills", "zero_hidden"])
def test_attention_kl_backward_becomes_its_kernel_launches(fills, mode):
    q1, k1, q2, k2 = (torch.empty(2, h, 33, d, dtype=torch.float16) for h, d in ((4, 16), (1, 16), (4, 24), (2, 24)))
    mode_fake = FakeTensorMode()
    fq = [_fake_like(mode_fake, x) for x in (q1, k1, q2, k2)]
    with mode_fake:  # statistics shaped as the forward makes them
        mask = _fake_like(mode_fake, _mask("bool", 33))
        rows, lse1, lse2, delta = torch.ops.fuser.attention_kl(*fq, mask, 0.25, 0.2, "top_left", "bool_drop", True,
                                                               KL_PLAN, *fills)
    stats = [torch.empty(t.shape, dtype=t.dtype) for t in (lse1, lse2, delta)]
    _check_inlined(torch.ops.fuser.attention_kl_backward.default,
                   (torch.empty(2, 4, 33), q1, k1, q2, k2, *stats, _mask("bool", 33), 0.25, 0.2, "top_left",
                    "bool_drop", f"split_k=1;backward={mode}", [True] * 4, *fills))


def _kda(t=40, h=2, k=32, v=48, dtype=torch.bfloat16, scalar_gate=False):
    q, kk = torch.empty(1, t, h, k, dtype=dtype), torch.empty(1, t, h, k, dtype=dtype)
    vv = torch.empty(1, t, h, v, dtype=dtype)
    g = torch.empty(1, t, h) if scalar_gate else torch.empty(1, t, h, k)
    return q, kk, vv, g, torch.empty(1, t, h, dtype=dtype)


@pytest.mark.parametrize("plan,t,k,v", [("plan=recurrent", 40, 32, 48), ("plan=recurrent", 8, 2048, 64),
                                        ("plan=chunk;chunk=64", 100, 32, 48), ("plan=parallel", 40, 32, 48)],
                         ids=["recurrent", "recurrent_streamed", "chunk", "parallel"])
@pytest.mark.parametrize("h0,want_state", [(False, False), (True, True)], ids=["stateless", "states"])
@pytest.mark.parametrize("scalar_gate", [False, True], ids=["channel_gate", "scalar_gate"])
def test_kda_forward_becomes_its_kernel_launches(plan, t, k, v, h0, want_state, scalar_gate):
    q, kk, vv, g, beta = _kda(t, 2, k, v, scalar_gate=scalar_gate)
    state = torch.empty(1, 2, k, v) if h0 else None
    _check_inlined(torch.ops.fuser.kda.default,
                   (q, kk, vv, g, beta, state, [1, 1, 1, 1, 1], 0, t, k ** -0.5, scalar_gate, 1, torch.bfloat16,
                    want_state, torch.float32, plan))


@pytest.mark.parametrize("h0", [False, True])
def test_kda_backward_becomes_its_kernel_launches(h0):
    q, kk, vv, g, beta = _kda(70)
    state = torch.empty(1, 2, 32, 48) if h0 else None
    _check_inlined(torch.ops.fuser.kda_backward.default,
                   (q, kk, vv, g, beta, state, torch.empty(1, 70, 2, 48, dtype=torch.bfloat16),
                    torch.empty(1, 2, 32, 48) if h0 else None, [1, 1, 1, 1, 1], 0, 70, 32 ** -0.5, False, 1))


def _symbolic_fakes(tensors, dynamic_dims):
    """Fake GPU tensors whose dims ``dynamic_dims`` are symbolic (duck-sized, as Dynamo marks a
    dim that changed between calls: equal sizes share a symbol), the rest static; with their
    shape environment: ``(env, mode, fakes)``. ``dynamic_dims``: one tuple of dims for every
    tensor, or a list of tuples, one per tensor."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    fakes = []
    for i, x in enumerate(tensors):
        if x is None:
            fakes.append(None)
            continue
        mine = dynamic_dims[i] if isinstance(dynamic_dims, list) else dynamic_dims
        dims = [DimDynamic.DUCK if d in mine else DimDynamic.STATIC for d in range(x.dim())]
        fakes.append(mode.from_tensor(torch.empty(x.shape, dtype=x.dtype, device=GPU),
                                      symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)))
    return env, mode, fakes


def _check_inlined_symbolic(fn, fakes, env, mode):
    """``fn(*fakes)`` traced as AOTAutograd does with symbolic sizes: only kernel launches and
    tensor ops, at least one launch grid symbolic, and the shape environment without a
    replacement (nothing specialised) and with one guard at most: that the rows fit one launch
    grid (``launch.MAX_GRID_ROWS``; past it a recompile keeps the opaque op, which slices them)."""
    with mode:
        gm = make_fx(dispatch_functionalize(fn), tracing_mode="symbolic")(*fakes)
    targets = _targets(gm)
    assert any("triton_kernel_wrapper_functional" in t for t in targets), targets
    assert not any(t.startswith("fuser.") for t in targets), targets
    grids = [n.kwargs["grid"] for n in gm.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)]
    assert any(isinstance(d, torch.fx.Node) for grid in grids for dims in grid for d in dims), grids
    guards = {str(g.expr) for g in env.guards}
    assert len(guards) <= 1 and all(g.endswith(f"<= {launch.MAX_GRID_ROWS}") for g in guards), guards
    assert not env.replacements, env.replacements
    _analysed_as_older_torch(gm)
    return gm


#: KDA with a symbolic batch (dim 0 of its [B, T, H, *] inputs, B=3: no other size equals it, so
#: duck sizing gives it its own symbol). The length stays static: a matched loop unrolls its steps
KDA_SYM_DIMS = (0,)


@pytest.mark.parametrize("h0,t0", [(False, 0), (True, 0), (False, 3)], ids=["plain", "h0_state", "time_window"])
@pytest.mark.parametrize("scalar_gate", [False, True], ids=["channel_gate", "scalar_gate"])
def test_kda_chunk_forward_and_backward_inline_with_symbolic_sizes(h0, t0, scalar_gate):
    # dynamic shapes (a batch or a length that changed between calls): the chunk plan's kernels
    # serve every size, so the op is inlined with symbolic grids, strides and workspaces
    q, kk, vv, g, beta = (x.expand(3, *x.shape[1:]) for x in _kda(100, 2, 32, 48, scalar_gate=scalar_gate))
    state = torch.empty(3, 2, 32, 48) if h0 else None
    do = torch.empty(3, 100, 2, 48, dtype=torch.bfloat16)
    env, mode, fakes = _symbolic_fakes((q, kk, vv, g, beta, state, do), KDA_SYM_DIMS)
    steps = 100 - t0
    rest = ([1, 1, 1, 1, 1], t0, steps, 32 ** -0.5, scalar_gate, 1)

    def fwd_bwd(q, k, v, g, beta, h0, do):
        o, s = torch.ops.fuser.kda(q, k, v, g, beta, h0, *rest, torch.bfloat16, True, torch.float32,
                                   "plan=chunk;chunk=64")
        grads = torch.ops.fuser.kda_backward(q, k, v, g, beta, h0, do[:, t0:], s if h0 is not None else None,
                                             *rest)
        return (o, s, *grads)

    _check_inlined_symbolic(fwd_bwd, fakes, env, mode)


def _kda_forward_symbolic_batch(t, k, v, h0, want_state, scalar_gate, plan):
    """``torch.ops.fuser.kda``'s forward as a function of fake GPU inputs with a symbolic batch (B=3
    of ``[B, T, 2, *]``): ``(fwd, fakes, env, mode, rest)`` (``rest``: the op's non-tensor arguments)."""
    q, kk, vv, g, beta = (x.expand(3, *x.shape[1:]) for x in _kda(t, 2, k, v, scalar_gate=scalar_gate))
    state = torch.empty(3, 2, k, v) if h0 else None
    env, mode, fakes = _symbolic_fakes((q, kk, vv, g, beta, state), KDA_SYM_DIMS)
    rest = ([1, 1, 1, 1, 1], 0, t, k ** -0.5, scalar_gate, 1, torch.bfloat16, want_state, torch.float32, plan)

    def fwd(q, k, v, g, beta, h0):
        return torch.ops.fuser.kda(q, k, v, g, beta, h0, *rest)

    return fwd, fakes, env, mode, rest


@pytest.mark.parametrize("t,k,v", [(8, 32, 48), (8, 2048, 64), (5, 256, 1000)], ids=["registers", "streamed", "wide"])
@pytest.mark.parametrize("h0,want_state", [(False, False), (True, True)], ids=["stateless", "states"])
@pytest.mark.parametrize("scalar_gate", [False, True], ids=["channel_gate", "scalar_gate"])
def test_kda_recurrent_forward_inlines_with_a_symbolic_batch(t, k, v, h0, want_state, scalar_gate):
    # a batch that changed between calls (serving): the recurrent kernel's config comes from K, V
    # and the dtype (the row count orders the candidates only when it is an int), so the op is
    # inlined with a symbolic number of value rows
    fwd, fakes, env, mode, _ = _kda_forward_symbolic_batch(t, k, v, h0, want_state, scalar_gate, "plan=recurrent")
    _check_inlined_symbolic(fwd, fakes, env, mode)


@pytest.mark.parametrize("k", [32, 128], ids=["states_recomputed", "states_kept"])
def test_kda_save_and_its_backward_inline_with_symbolic_sizes(k):
    q, kk, vv, g, beta = (x.expand(3, *x.shape[1:]) for x in _kda(100, 2, k, 48))
    do = torch.empty(3, 100, 2, 48, dtype=torch.bfloat16)
    env, mode, fakes = _symbolic_fakes((q, kk, vv, g, beta, do), KDA_SYM_DIMS)
    rest = ([1, 1, 1, 1, 1], 0, 100, k ** -0.5, False, 1)

    def fwd_bwd(q, k, v, g, beta, do):
        o, s, *saved = torch.ops.fuser.kda_save(q, k, v, g, beta, None, *rest, torch.bfloat16, False,
                                                torch.float32, "plan=chunk;chunk=64;dots=float32;save=workspaces")
        return (o, *torch.ops.fuser.kda_backward_saved(q, k, v, g, beta, None, do, None, *saved, *rest, 64))

    _check_inlined_symbolic(fwd_bwd, fakes, env, mode)


#: attention-KL with a symbolic batch and length (dims 0 and 2 of [B, H, N, D]; B=3, N=37: sizes
#: no other dim has, so duck sizing gives each its own symbol)
KL_SYM_DIMS = (0, 2)


@pytest.mark.parametrize("causal,fills", [("none", 0), ("top_left", 0), ("bottom_right", 0), ("top_left", 1),
                                          ("bottom_right", 2)])
@pytest.mark.parametrize("nk", [37, 53, 29])
@pytest.mark.parametrize("teacher_grad", [False, True], ids=["frozen_teacher", "both_sides"])
def test_attention_kl_forward_and_backward_inline_with_symbolic_sizes(causal, fills, nk, teacher_grad):
    # dynamic shapes (a batch or a length that changed between calls): the one-pass forward and the
    # two-kernel backward serve every size, so the ops are inlined with symbolic grids and strides;
    # Nq = 37 and Nk its own symbol (or the same), finite causal fills (added, or replacing with
    # hidden entries zeroed)
    fills = [KL_FILLS[0], (INF, INF, -2.0, -3.0, "add", False), (INF, INF, -2.0, -3.0, "replace", True)][fills]
    q1, q2 = torch.empty(3, 4, 37, 16, dtype=torch.float16), torch.empty(3, 4, 37, 24, dtype=torch.float16)
    k1, k2 = torch.empty(3, 1, nk, 16, dtype=torch.float16), torch.empty(3, 2, nk, 24, dtype=torch.float16)
    g = torch.empty(3, 4, 37)
    env, mode, fakes = _symbolic_fakes((q1, k1, q2, k2, g), KL_SYM_DIMS)
    needs = [teacher_grad, teacher_grad, True, True]

    def fwd_bwd(q1, k1, q2, k2, g):
        rows, lse1, lse2, delta = torch.ops.fuser.attention_kl(q1, k1, q2, k2, None, 0.25, 0.2, causal, "none", True,
                                                               KL_PLAN, *fills)
        grads = torch.ops.fuser.attention_kl_backward(g, q1, k1, q2, k2, lse1, lse2, delta, None, 0.25, 0.2, causal,
                                                      "none", KL_PLAN, needs, *fills)
        return (rows, *grads)

    _check_inlined_symbolic(fwd_bwd, fakes, env, mode)


@pytest.mark.parametrize("why", ["split_k", "atomic_dq", "mask"])
def test_attention_kl_variants_sized_from_the_lengths_stay_opaque_with_symbolic_sizes(why):
    q1, k1, q2, k2 = (torch.empty(3, h, 37, d, dtype=torch.float16) for h, d in ((4, 16), (1, 16), (4, 24), (2, 24)))
    env, mode, fakes = _symbolic_fakes((q1, k1, q2, k2), KL_SYM_DIMS)
    plan = {"split_k": "split_k=2;backward=two_kernel", "atomic_dq": "split_k=1;backward=atomic_dq"}.get(why, KL_PLAN)
    mask = why == "mask"

    def fwd(q1, k1, q2, k2):
        m = torch.ones(q1.shape[2], k1.shape[2], dtype=torch.bool, device=q1.device) if mask else None
        out = torch.ops.fuser.attention_kl(q1, k1, q2, k2, m, 0.25, 0.2, "none", "bool_keep" if mask else "none",
                                           True, plan, *KL_FILLS[0])
        if why != "atomic_dq":
            return out
        return torch.ops.fuser.attention_kl_backward(out[0], q1, k1, q2, k2, *out[1:], None, 0.25, 0.2, "none", "none",
                                                     plan, [False, False, True, True], *KL_FILLS[0])

    with mode:
        gm = make_fx(dispatch_functionalize(fwd), tracing_mode="symbolic")(*fakes)
    targets = _targets(gm)
    opaque = "fuser.attention_kl_backward.default" if why == "atomic_dq" else "fuser.attention_kl.default"
    assert opaque in targets, targets


#: attention with a symbolic batch and symbolic lengths (dims 0 and 2 of [B, H, N, D]; B=3, Nq and
#: Nk 37/53 in both orders: sizes no other dim has, so each is its own symbol; a mask's batch and
#: length dims symbolic too); the variants of ATTN_VARIANTS and those whose skipping flags depend on
#: Nk - Nq (a finite causal fill at the bottom-right diagonal; a data mask's skipping offset)
ATTN_SYM_VARIANTS = ATTN_VARIANTS + [
    ("bottom_right", "none", None, (INF, F32_MIN, "add", "", [], INF, "replace")),
    ("top_left", "none", None, (INF, -1e4, "replace", "", [], INF, "replace")),
    ("bottom_right", "additive", "float4", (INF, INF, "replace", "", [], INF, "replace")),
]
ATTN_SYM_IDS = ATTN_IDS + ["bottom_right_fill", "top_left_fill", "full_additive"]


def _attention_symbolic(nq, nk, mask_kind_of_tensor, head_dim_dynamic=False, heads_dynamic=False):
    """(env, mode, fakes): q [3, 6, Nq, 32], k and v [3, 2, Nk, 32], the mask (None, "bool"
    [3, 1, 1, Nk], "float" [3, 1, Nq, Nk], "float4" [3, 6, Nq, Nk]) and dout, as fake GPU tensors
    with the batch and the lengths symbolic (also the head dim or the head counts if asked)."""
    q, do = (torch.empty(3, 6, nq, 32, dtype=torch.float16) for _ in range(2))
    k, v = (torch.empty(3, 2, nk, 32, dtype=torch.float16) for _ in range(2))
    mask = {None: None, "bool": torch.zeros(3, 1, 1, nk, dtype=torch.bool), "float": torch.zeros(3, 1, nq, nk),
            "float4": torch.zeros(3, 6, nq, nk)}[mask_kind_of_tensor]
    dims = (0, 2) + ((3,) if head_dim_dynamic else ()) + ((1,) if heads_dynamic else ())
    mask_dims = (0,) + tuple(d for d in (2, 3) if mask is not None and mask.shape[d] > 1)
    return _symbolic_fakes((q, k, v, mask, do), [dims, dims, dims, mask_dims, dims])


@pytest.mark.parametrize("nq,nk", [(37, 53), (53, 37)])
@pytest.mark.parametrize("mode", ["two_kernel", "atomic_dq"])
@pytest.mark.parametrize("causal,mask_kind,mask,fills", ATTN_SYM_VARIANTS, ids=ATTN_SYM_IDS)
def test_attention_forward_and_backward_inline_with_symbolic_sizes(causal, mask_kind, mask, fills, mode, nq, nk):
    # dynamic shapes (a batch or a length that changed between calls): the kernels and configs
    # depend on the dtype, head dims and variant only, so the ops are inlined with symbolic grids,
    # strides and offsets (Nk - Nq), without a guard beyond the rows'
    env, fmode, fakes = _attention_symbolic(nq, nk, mask)
    plan = f"backward={mode};autotune=0"

    def fwd_bwd(q, k, v, m, do):
        out, lse = torch.ops.fuser.attention(q, k, v, m, 0.25, causal, mask_kind, True, plan, *fills)
        return (out, *torch.ops.fuser.attention_backward(do, q, k, v, out, lse, m, 0.25, causal, mask_kind, plan,
                                                          [True, True, True], *fills))

    _check_inlined_symbolic(fwd_bwd, fakes, env, fmode)


@pytest.mark.parametrize("why", ["autotune", "backward_autotune", "head_dim", "heads"])
def test_attention_choices_sized_from_symbolic_sizes_stay_opaque(why):
    # autotuning times each length bucket; head dims key the config tables; head counts the GQA
    # grouping: with these symbolic the op stays opaque (its kernels chosen when it runs)
    env, fmode, fakes = _attention_symbolic(37, 53, None, head_dim_dynamic=why == "head_dim",
                                            heads_dynamic=why == "heads")
    plan = {"autotune": "backward=two_kernel;autotune=1", "backward_autotune": "backward=autotune;autotune=0"}.get(
        why, ATTN_PLAN)
    args = (0.25, "none", "none", True, plan, INF, INF, "replace", "", [], INF, "replace")

    def fwd_bwd(q, k, v, m, do):
        out, lse = torch.ops.fuser.attention(q, k, v, None, *args)
        return (out, *torch.ops.fuser.attention_backward(do, q, k, v, out, lse, None, 0.25, "none", "none", plan,
                                                          [True, True, True], *args[5:]))

    with fmode:
        gm = make_fx(dispatch_functionalize(fwd_bwd), tracing_mode="symbolic")(*fakes)
    targets = _targets(gm)
    assert "fuser.attention.default" in targets and "fuser.attention_backward.default" in targets, targets
    assert not any("triton_kernel_wrapper" in t for t in targets), targets
    assert not env.replacements, env.replacements


def test_kda_parallel_with_an_initial_state_stays_opaque_with_symbolic_sizes():
    # the split kernels' h0 projection chooses its key split from the row count: a symbolic batch
    # keeps the opaque op (the one-launch kernel's does not: the next test; K = 256 takes the split
    # kernels by default)
    q, kk, vv, g, beta = (x.expand(3, *x.shape[1:]) for x in _kda(8, 2, 256, 48))
    env, mode, fakes = _symbolic_fakes((q, kk, vv, g, beta, torch.empty(3, 2, 256, 48)), KDA_SYM_DIMS)
    rest = ([1, 1, 1, 1, 1], 0, 8, 256 ** -0.5, False, 1, torch.bfloat16, True, torch.float32, "plan=parallel")
    with mode:
        gm = make_fx(dispatch_functionalize(lambda *xs: torch.ops.fuser.kda(*xs, *rest)),
                     tracing_mode="symbolic")(*fakes)
    assert "fuser.kda.default" in _targets(gm)
    assert launch.stays_opaque((*fakes, *rest), {}, "fuser::kda") == "symbolic sizes"
    assert launch.stays_opaque((*fakes, *rest), {}, "fuser::an_op_without_a_rule") == "symbolic sizes"


@pytest.mark.parametrize("t,k,v", [(8, 32, 48), (16, 256, 1000), (40, 32, 48), (8, 8192, 64)],
                         ids=["short", "short_wide", "long", "short_large_k"])
@pytest.mark.parametrize("want_state", [False, True], ids=["output_only", "final_state"])
@pytest.mark.parametrize("scalar_gate", [False, True], ids=["channel_gate", "scalar_gate"])
@pytest.mark.parametrize("fused,h0", [(False, False), (True, False), (True, True)],
                         ids=["split", "fused", "fused_h0"])
def test_kda_parallel_forward_inlines_with_a_symbolic_batch(t, k, v, want_state, scalar_gate, fused, h0, monkeypatch):
    # a batch that changed between calls (serving short sequences): the parallel plan's config
    # comes from K, V and T (the table's choices made from N keep their general values), its
    # workspaces are sized by expressions in N; the one-launch kernel (FUSED) as well, with an
    # initial state too (no key split to choose) where T <= 16 (past it: the split kernels, opaque)
    from fuser.codegen import kda_parallel as kp

    short = kp._short_config  # the table's default (FUSED at K <= 64, V <= 128) overridden either way
    monkeypatch.setattr(kp, "_short_config", lambda base, *a: dict(short(base, *a) or base, FUSED=fused))
    kp._candidates.cache_clear()
    try:
        fwd, fakes, env, mode, rest = _kda_forward_symbolic_batch(t, k, v, h0, want_state, scalar_gate,
                                                                  "plan=parallel")
        if h0 and t > 16:
            assert launch.stays_opaque((*fakes, *rest), {}, "fuser::kda") == "symbolic sizes"
            return

        gm = _check_inlined_symbolic(fwd, fakes, env, mode)
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        kernels = {kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in gm.graph.nodes
                   if "triton_kernel_wrapper" in str(n.target)}
        if fused and t <= 16:
            assert kernels == {"kda_parallel_fused_kernel"}, kernels
        else:
            assert {"kda_parallel_prep_kernel", "kda_parallel_solve_kernel"} <= kernels, kernels
            assert ("kda_parallel_state_kernel" in kernels) == want_state, kernels
            assert "kda_parallel_fused_kernel" not in kernels, kernels
    finally:
        kp._candidates.cache_clear()


def test_kda_with_a_symbolic_length_stays_opaque():
    # a symbolic length specialised a size when traced (the saved workspaces' padded length):
    # the rule keeps those calls opaque, forward and backward
    q, kk, vv, g, beta = (x.expand(3, *x.shape[1:]) for x in _kda(100, 2, 32, 48))
    do = torch.empty(3, 100, 2, 48, dtype=torch.bfloat16)
    env, mode, fakes = _symbolic_fakes((q, kk, vv, g, beta, do), (0, 1))
    t = fakes[0].shape[1]
    rest = ([1, 1, 1, 1, 1], 0, t, 32 ** -0.5, False, 1)

    def fwd_bwd(q, k, v, g, beta, do):
        o, _ = torch.ops.fuser.kda(q, k, v, g, beta, None, *rest, torch.bfloat16, False, torch.float32,
                                   "plan=chunk;chunk=64")
        return (o, *torch.ops.fuser.kda_backward(q, k, v, g, beta, None, do, None, *rest))

    with mode:
        gm = make_fx(dispatch_functionalize(fwd_bwd), tracing_mode="symbolic")(*fakes)
    targets = _targets(gm)
    assert "fuser.kda.default" in targets and "fuser.kda_backward.default" in targets, targets
    assert not any("triton_kernel_wrapper" in x for x in targets), targets


def test_cpu_tensors_keep_the_opaque_op():
    q, k, v = _qkv(dtype=torch.float32)
    gm, _, _ = _trace(torch.ops.fuser.attention.default,
                      (q, k, v, None, 0.25, "none", "none", True, ATTN_PLAN, INF, INF, "replace", "", [], INF,
                       "replace"), device="cpu")
    targets = _targets(gm)
    assert "fuser.attention.default" in targets
    assert not any("triton_kernel_wrapper" in t for t in targets)


def test_opaque_ops_when_inlining_is_off(monkeypatch):
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", False)
    q, k, v = _qkv()
    gm, _, _ = _trace(torch.ops.fuser.attention.default,
                      (q, k, v, None, 0.25, "none", "none", True, ATTN_PLAN, INF, INF, "replace", "", [], INF,
                       "replace"))
    assert "fuser.attention.default" in _targets(gm)


KERNEL_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def uncast(X, scale, N: tl.constexpr):
    tl.store(X + tl.arange(0, N), tl.load(X + tl.arange(0, N)) * scale)


@triton.jit
def cast(X, scale, N: tl.constexpr):
    scale = tl.cast(scale, tl.float32)
    tl.store(X + tl.arange(0, N), tl.load(X + tl.arange(0, N)) * scale)
'''


def test_a_float_argument_without_its_cast_is_refused_while_traced(tmp_path, monkeypatch):
    import importlib.util

    path = tmp_path / "float_kernels.py"
    path.write_text(KERNEL_SOURCE)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = importlib.util.spec_from_file_location("float_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert launch.jit_call(mod.uncast) is mod.uncast  # not traced: Triton's own launcher
    mode = FakeTensorMode()
    x = _fake_like(mode, torch.empty(16))

    def run(kernel):
        def f(x):
            launch.jit_call(kernel)[(1,)](x, 0.5, N=16)
            return x
        with mode:
            return make_fx(dispatch_functionalize(f))(x)

    with pytest.raises(RuntimeError, match=r"float argument 'scale'.*tl\.cast\(scale, tl\.float32\)"):
        run(mod.uncast)
    gm = run(mod.cast)
    assert any("triton_kernel_wrapper_functional" in t for t in _targets(gm))


def test_autotuning_while_traced_takes_the_cached_winner_or_the_default(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "_tune_file", lambda: tmp_path / "autotune.json")
    launch._tune_mem.pop("k-traced", None)
    ran = []
    with FakeTensorMode():
        assert launch.autotune("k-traced", [{"a": 1}, {"a": 2}], ran.append) == {"a": 1}
    assert ran == [] and "k-traced" not in launch._tune_mem  # nothing timed, nothing remembered
    launch._tune_mem["k-traced"] = {"a": 2}
    with FakeTensorMode():
        assert launch.autotune("k-traced", [{"a": 1}, {"a": 2}], ran.append) == {"a": 2}
    launch._tune_mem.pop("k-traced")


def test_stand_ins_for_autotuning_keep_sizes_strides_and_dtypes():
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(2, 40, 4, 16, dtype=torch.float16).transpose(1, 2)
        m = torch.empty(2, 1, 1, 40, dtype=torch.bool).expand(2, 4, 40, 40)
    for fake in (x, m):
        real = launch._stand_in(fake)
        assert type(real) is torch.Tensor
        assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)


def test_kernels_still_compile_after_the_interpreter_ran():
    # Triton 3.9's interpreter leaves the language patched after a jitted helper's call; fuser's
    # interpreter_mode undoes it, or Inductor's analysis of the kernels (and any GPU compile) in
    # the same process fails and every input is copied
    from fuser.codegen import attention as kernels

    q = torch.randn(1, 2, 20, 16)
    kernels.forward(q, q, q, scale=0.25, causal="top_left", mask=None, mask_kind="none", need_lse=True)
    test_attention_forward_becomes_its_kernel_launch("top_left", "none", None, ATTN_VARIANTS[1][3], True)



@pytest.mark.parametrize("case", ["static", "dynamic", "opaque_ops"])
def test_explain_says_when_a_fused_op_launches_from_python(case, monkeypatch):
    # an emitted op with symbolic sizes whose kernels are chosen from the sizes (here the split-K
    # KL forward) stays an opaque op: the match says so (explain's "launch:" line); with static
    # sizes Inductor launches its kernels and it says nothing
    from torch import fx

    from fuser import passes, report
    from fuser.pattern import Match

    if case == "opaque_ops":
        monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", False)
    q1, k1, q2, k2 = (torch.empty(3, h, 37, d, dtype=torch.float16) for h, d in ((4, 16), (1, 16), (4, 24), (2, 24)))
    if case == "dynamic":
        _, mode, fakes = _symbolic_fakes((q1, k1, q2, k2), (0, 2))  # a symbolic batch and length
    else:
        mode = FakeTensorMode()
        fakes = [_fake_like(mode, x) for x in (q1, k1, q2, k2)]
    graph = fx.Graph()
    inputs = []
    for i, f in enumerate(fakes):
        inputs.append(graph.placeholder(f"x{i}"))
        inputs[-1].meta["val"] = f
    node = graph.call_function(torch.ops.fuser.attention_kl.default,
                               (*inputs, None, 0.25, 0.2, "none", "none", True, "split_k=2;backward=two_kernel",
                                *KL_FILLS[0]))
    why = passes._opaque_launch([*inputs, node])
    assert why == {"static": "", "dynamic": "symbolic sizes", "opaque_ops": "opaque ops"}[case]
    m = Match("attention_kl", node, frozenset([node]), {}, {}, "x.py:1", launch=why)
    text = str(report.Report(matches=[m], graphs=1))
    assert ("launch: its kernels are launched from Python on every call" in text) == (case != "static"), text
