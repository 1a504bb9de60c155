"""The attention forward's tensor-descriptor paths (``desc="host"``: 4-D host
``TensorDescriptor``s; ``desc="device"``: per-head ``tl.make_tensor_descriptor``) against the
float64 reference, forced in Triton's interpreter (``FUSER_ATTN_TMA`` / ``tma=``), and the
launcher's choice of path (:func:`fuser.codegen.attention.desc_mode`).

Outputs are allocated poisoned (NaN): a row a descriptor store misses shows up; rows past a
ragged N must not be written (a descriptor over the whole [B, H, N, D] tensor zero-fills and
clips per head).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_attention_kernels import _check, _qkv

from fuser.codegen import attention, launch
from fuser.patterns.attention import reference

DESC = ("host", "device")


@pytest.fixture
def force(monkeypatch):
    """Force a forward path for every call (as ``FUSER_ATTN_TMA`` does)."""

    def set_mode(mode):
        monkeypatch.setattr(attention, "TMA_SETTING", mode)

    return set_mode


SHAPES = [
    # id, B, Hq, Hkv, Nq, Nk, D, Dv, causal (Nq, Nk ragged against the interpreter's 16/32 tiles)
    ("ragged", 2, 2, 2, 37, 50, 32, 32, "none"),
    ("dv_differs", 1, 2, 2, 45, 33, 32, 16, "none"),
    ("top_left_q<k", 1, 2, 2, 50, 67, 32, 32, "top_left"),
    ("top_left_q>k", 1, 2, 2, 67, 37, 16, 32, "top_left"),
    ("bottom_right_q<k", 2, 2, 2, 37, 67, 32, 32, "bottom_right"),
    ("bottom_right_q>k_empty_rows", 1, 2, 2, 67, 37, 32, 16, "bottom_right"),
    ("gqa_4_2_top_left", 2, 4, 2, 37, 50, 32, 32, "top_left"),
    ("mqa_4_1_bottom_right", 1, 4, 1, 45, 45, 16, 16, "bottom_right"),
    ("single_query", 2, 2, 1, 1, 67, 32, 32, "bottom_right"),
    ("d64", 1, 2, 2, 40, 33, 64, 64, "none"),
]


@pytest.mark.parametrize("desc", DESC)
@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
def test_fp32(force, desc, case):
    force(desc)
    _, b, hq, hkv, n_q, n_k, d, dv, causal = case
    q, k, v = _qkv(100 + SHAPES.index(case), b, hq, hkv, n_q, n_k, d, dv)
    assert attention.desc_mode(q, k, v, attention.alloc_out(q, v)) == desc
    out, lse, _ = _check(q, k, v, causal=causal, grad=False)
    if case[0] == "bottom_right_q>k_empty_rows":
        assert (out[:, :, : n_q - n_k] == 0).all() and torch.isposinf(lse[:, :, : n_q - n_k]).all()


@pytest.mark.parametrize("desc", DESC)
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_fp16(force, desc, causal):
    force(desc)
    q, k, v = _qkv(120, 2, 4, 2, 67, 53, 64, 32, dtype=torch.float16)
    _check(q, k, v, causal=causal, grad=False)


@pytest.mark.parametrize("desc", DESC)
def test_training_uses_descriptor_forward(force, desc):
    # the forward's out and LSE feed the (pointer) backward unchanged
    force(desc)
    q, k, v = _qkv(121, 1, 4, 2, 37, 45, 32, 32)
    _check(q, k, v, causal="bottom_right", modes=("two_kernel",))


@pytest.mark.parametrize("desc", DESC)
def test_strided_views_of_fused_qkv(force, desc):
    # [B, N, 3, H, D] memory: q, k, v are [B, H, N, D] views with strides (N*3*H*D, D, 3*H*D, 1)
    force(desc)
    b, n, h, d = 2, 45, 2, 32
    gen = torch.Generator().manual_seed(122)
    qkv = torch.randn(b, n, 3, h, d, generator=gen)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    assert attention.desc_mode(q, k, v, attention.alloc_out(q, v)) == desc
    _check(q, k, v, causal="top_left", grad=False)


@pytest.mark.parametrize("desc", DESC)
def test_given_poisoned_strided_output(force, desc):
    # a caller's output buffer, strided ([B, H, N, D] memory behind a [B, N, H, D] view is the
    # default; here [B, H, N, D] contiguous), NaN-filled: every row is written, nothing past Nq
    force(desc)
    q, k, v = _qkv(123, 2, 2, 2, 37, 29, 32, 32)
    big = torch.full((2, 2, 48, 32), float("nan"))
    out = big[:, :, :37]
    got, _ = attention.forward(q, k, v, scale=0.3, causal="bottom_right", out=out)
    assert got is out
    ref, _ = reference(q, k, v, scale=0.3, causal="bottom_right")
    assert (got - ref).abs().max().item() < 1e-4
    assert big[:, :, 37:].isnan().all(), "rows past Nq must not be written"


@pytest.mark.parametrize("desc", DESC)
@pytest.mark.parametrize("kind", ["bool_keep", "additive"])
def test_masks_unchanged(force, desc, kind):
    force(desc)
    q, k, v = _qkv(124, 2, 2, 2, 37, 50, 32, 32)
    gen = torch.Generator().manual_seed(125)
    if kind == "bool_keep":
        mask = torch.rand(2, 1, 37, 50, generator=gen) > 0.3
        mask[..., 0] = True
    else:
        mask = torch.randn(2, 2, 37, 50, generator=gen)
        mask[..., 3] = -math.inf
    _check(q, k, v, mask=mask, mask_kind=kind, causal="top_left", grad=False)


@pytest.mark.parametrize("desc", DESC)
def test_predicate_and_fills(force, desc):
    force(desc)
    q, k, v = _qkv(126, 1, 2, 1, 45, 61, 32, 32)
    window = ("and", ("atom", 1, -1, 0), ("atom", -1, 1, 1))  # i - C1 <= j <= i + C0
    _check(q, k, v, mask_pred=window, pred_consts=(16, 8), grad=False)
    _check(q, k, v, mask_pred=window, pred_consts=(3, 20), pred_fill=-50.0, grad=False)
    _check(q, k, v, causal="top_left", causal_fill=-1e4, causal_fill_mode="add", grad=False)


@pytest.mark.parametrize("desc", DESC)
def test_need_lse_false(force, desc):
    force(desc)
    q, k, v = _qkv(127, 2, 2, 2, 37, 50, 32, 32)
    _, lse, _ = _check(q, k, v, causal="bottom_right", need_lse=False, grad=False)
    assert lse is None


# --- the launcher's choice ------------------------------------------------------------------


def test_auto_is_pointers_on_a_gpu_too(monkeypatch):
    """The default is pointers also on Hopper with a layout descriptors could take (desc_mode:
    measured slower on the traced path, ~27 us more host time eagerly); an unknown
    FUSER_ATTN_TMA value is an error that names the variable."""
    q, k, v = (t.half() for t in _qkv(131, 1, 2, 2, 64, 64, 64, 64))
    out = attention.alloc_out(q, v)
    monkeypatch.setattr(launch, "interpreted", lambda device: False)
    monkeypatch.setattr(launch, "device_kind", lambda device: "sm90")
    monkeypatch.setattr(attention, "TMA_SETTING", "auto")
    assert attention.desc_mode(q, k, v, out) == "none"
    assert attention.desc_mode(q, k, v, out, "host") == "host"
    monkeypatch.setattr(attention, "TMA_SETTING", "yes")
    with pytest.raises(ValueError, match="FUSER_ATTN_TMA"):
        attention.desc_mode(q, k, v, out)


def test_auto_is_pointers_in_the_interpreter():
    q, k, v = _qkv(130, 1, 2, 2, 16, 16, 32, 32)
    out = attention.alloc_out(q, v)
    assert attention.TMA_SETTING == "auto" or pytest.skip("FUSER_ATTN_TMA is set")
    assert attention.desc_mode(q, k, v, out) == "none"
    assert attention.desc_mode(q, k, v, out, "host") == "host"
    assert attention.desc_mode(q, k, v, out, "device") == "device"
    assert attention.desc_mode(q, k, v, out, "off") == "none"
    with pytest.raises(ValueError):
        attention.desc_mode(q, k, v, out, "tma")


@pytest.mark.parametrize("desc", DESC)
def test_layouts_descriptors_cannot_take_use_pointers(force, desc):
    force(desc)
    # head dim not a power of two (padded inside the kernel)
    q, k, v = _qkv(131, 1, 2, 2, 20, 30, 24, 24)
    assert attention.desc_mode(q, k, v, attention.alloc_out(q, v)) == "none"
    # a stride that is not a multiple of 16 bytes (fp16 rows of 36 elements, 72 bytes)
    wide = torch.randn(1, 2, 20, 36).half()
    q = wide[..., :32]
    k, v = torch.randn(1, 2, 30, 32).half(), torch.randn(1, 2, 30, 32).half()
    assert attention.desc_mode(q, k, v, attention.alloc_out(q, v)) == "none"
    # a base that is not 16-byte aligned (one fp32 element in)
    flat = torch.randn(1 * 2 * 20 * 32 + 1)
    q = flat[1:].view(1, 2, 20, 32)
    k, v = torch.randn(1, 2, 30, 32), torch.randn(1, 2, 30, 32)
    assert attention.desc_mode(q, k, v, attention.alloc_out(q, v)) == "none"
    with launch.poison_outputs():
        out, _ = attention.forward(q, k, v, scale=0.2, causal="top_left")
    ref, _ = reference(q, k, v, scale=0.2, causal="top_left")
    assert (out - ref).abs().max().item() < 1e-4
    # a non-contiguous last dim
    q = torch.randn(1, 2, 32, 20).transpose(2, 3)
    k, v = torch.randn(1, 2, 30, 32), torch.randn(1, 2, 30, 32)
    assert attention.desc_mode(q, k, v, attention.alloc_out(q, v)) == "none"


def test_host_request_while_traced_is_device(monkeypatch):
    # wrap_triton outside Dynamo cannot carry host descriptors (see desc_mode)
    q, k, v = _qkv(132, 1, 2, 2, 16, 16, 32, 32)
    out = attention.alloc_out(q, v)
    monkeypatch.setattr(launch, "tracing", lambda: True)
    assert attention.desc_mode(q, k, v, out, "host") == "device"
    assert attention.desc_mode(q, k, v, out, "device") == "device"
    assert attention.desc_mode(q, k, v, out, "none") == "none"


def test_rendered_variants_are_distinct():
    kw = dict(causal="top_left", mask_kind="none", mask_row_broadcast=False, need_lse=True, interpret=False)
    srcs = {d: attention.fwd_kernel(desc=d, **kw) for d in attention.DESC_MODES}
    assert len({s.path for s in srcs.values()}) == 3
    assert "TensorDescriptor(x, " in srcs["host"].source
    assert "tl.make_tensor_descriptor" in srcs["device"].source
    assert "make_tensor_descriptor" not in srcs["none"].source and "TensorDescriptor" not in srcs["none"].source
    with pytest.raises(ValueError):
        attention.fwd_kernel(desc="tma", **kw)


# --- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 777, 1029, 64), (2, 4, 1, 513, 300, 128)])
def test_gpu_paths_match_sdpa(causal, shape):
    b, hq, hkv, n_q, n_k, d = shape
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, hq, n_q, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n_k, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n_k, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref, _ = reference(q, k, v, scale=d ** -0.5, causal=causal)
    outs = {}
    for tma in attention.DESC_MODES:
        with launch.poison_outputs():
            out, lse = attention.forward(q, k, v, scale=d ** -0.5, causal=causal, tma=tma)
        assert not out.isnan().any(), tma
        err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
        assert err < 3e-2, (tma, err)
        outs[tma] = out
    torch.testing.assert_close(outs["host"], outs["none"], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["device"], outs["none"], atol=2e-2, rtol=2e-2)


# --- traced for Inductor (fake GPU tensors; no GPU needed) ---------------------------------


@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_device_descriptors_traced_for_inductor(monkeypatch, causal):
    """The op's body traced as AOTAutograd hands it to Inductor (``meta`` tensors standing for CUDA
    ones, an H100 target named, as tests/patterns/test_inline_ops.py does), with the device
    descriptors forced: one ``triton_kernel_wrapper_functional`` launch whose mutation analysis
    (torch's TTIR walk, through ``tt.make_tensor_descriptor`` and ``tt.descriptor_store``) finds
    that the kernel writes ``Out`` (and the LSE) and no input."""
    import triton
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.backends.compiler import GPUTarget

    import fuser  # noqa: F401  (registers torch.ops.fuser.*)

    monkeypatch.setattr(launch, "device_properties",
                        lambda index: {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": (9, 0)})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", True)
    monkeypatch.setattr(launch, "INLINE_DEVICE_TYPES", ("cuda", "meta"))

    class _H100Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", _H100Driver())
    monkeypatch.setattr(attention, "TMA_SETTING", "host")  # traced: becomes "device"
    seen = []
    real = attention.desc_mode
    monkeypatch.setattr(attention, "desc_mode", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])

    mode = FakeTensorMode()
    with mode:
        q = torch.empty(2, 4, 40, 64, dtype=torch.float16, device="meta")
        k = torch.empty(2, 2, 40, 64, dtype=torch.float16, device="meta")
        v = torch.empty(2, 2, 40, 64, dtype=torch.float16, device="meta")
        args = (q, k, v, None, 0.125, causal, "none", True, "backward=two_kernel;autotune=0",
                -math.inf, -math.inf, "replace", "", [], -math.inf, "replace")
        gm = make_fx(dispatch_functionalize(lambda *xs: torch.ops.fuser.attention.default(*xs)))(*args)
    assert seen == ["device"]
    launches = [n for n in gm.graph.nodes if "triton_kernel_wrapper_functional" in str(n.target)]
    assert len(launches) == 1, [str(n.target) for n in gm.graph.nodes]
    node = launches[0]
    written = set(node.kwargs["tensors_to_clone"])
    assert "Out" in written and "LSE" in written, written
    assert not {"Q", "K", "V"} & written, written


def test_descriptor_config_tables(monkeypatch):
    for table in (attention._FWD_DESC_TABLE, attention._FWD_DESC_CAUSAL_TABLE):
        for key, cands in table.items():
            assert key in attention._FWD_TABLE and cands
            for c in cands:
                launch.check_config(c)
                assert c["num_warps"] in (1, 2, 4, 8) and c["num_stages"] >= 1
    monkeypatch.setattr(launch, "device_kind", lambda device: "sm90")
    kw = dict(head_dim=128, head_dim_v=128, dtype=torch.bfloat16, device="cuda", kind="fwd")
    assert attention.candidate_configs(desc="host", **kw) == attention._FWD_DESC_TABLE[("sm90", 128, 2)]
    assert attention.candidate_configs(desc="device", causal="top_left", **kw) == \
        attention._FWD_DESC_CAUSAL_TABLE[("sm90", 128, 2)]
    assert attention.candidate_configs(**kw) == attention._FWD_TABLE[("sm90", 128, 2)]
    # keys without a descriptor entry keep the pointer tables
    kw64 = dict(kw, head_dim=64, head_dim_v=64)
    assert attention.candidate_configs(desc="host", **kw64) == attention._FWD_TABLE[("sm90", 64, 2)]
    assert attention.candidate_configs(desc="host", causal="top_left", **kw64) == \
        attention._FWD_CAUSAL_TABLE[("sm90", 64, 2)]


def test_automatic_descriptor_failure_falls_back_to_pointers(monkeypatch, caplog):
    """A descriptor kernel that fails to build (e.g. a Triton that cannot lower it) on an
    automatic choice: a warning, the next path (host -> device -> pointers), and that path for
    that (dtype, D, Dv) from then on. (Played in the interpreter with the forward told it is on
    a GPU.)"""
    q, k, v = _qkv(140, 1, 2, 2, 37, 40, 32, 32)
    ref, _ = reference(q, k, v, scale=0.2, causal="top_left")
    real_module, real_launching = attention._fwd_module, launch.launching
    built, failing = [], {"host"}

    def module(*a):
        *rest, desc = a
        built.append(desc)
        if desc in failing:
            raise RuntimeError("PassManager::run failed (stand-in)")
        rest[4] = True  # the interpreted kernel stands for the compiled one
        return real_module(*rest, desc)

    monkeypatch.setattr(attention, "TMA_SETTING", "host")
    monkeypatch.setattr(attention, "_DESC_FAILED", set())
    monkeypatch.setattr(attention, "_fwd_module", module)
    monkeypatch.setattr(attention, "_configs", lambda *a, **kw: [dict(c) for c in attention._INTERP_FWD])
    monkeypatch.setattr(launch, "interpreted", lambda device: False)
    monkeypatch.setattr(launch, "launching", lambda interpret: real_launching(True))
    monkeypatch.setattr(attention, "_ensure_allocator", lambda: None)  # no GPU: no scratch allocator
    with caplog.at_level("WARNING", logger="fuser"), launch.poison_outputs():
        out, _ = attention.forward(q, k, v, scale=0.2, causal="top_left")
    assert built == ["host", "device"] and "host-descriptor kernel failed" in caplog.text
    assert (out - ref).abs().max().item() < 1e-4
    built.clear()
    attention.forward(q, k, v, scale=0.2, causal="top_left")
    assert built == ["device"]  # remembered
    failing.add("device")
    built.clear()
    with launch.poison_outputs():
        out, _ = attention.forward(q, k, v, scale=0.2, causal="top_left")
    assert built == ["device", "none"] and (out - ref).abs().max().item() < 1e-4
    built.clear()
    attention.forward(q, k, v, scale=0.2, causal="top_left")
    assert built == ["none"]


def test_host_descriptor_forms():
    # 3-D over [B, N, H * D] where the heads lie side by side in [B, N, H, D] memory, else 4-D
    kernel = attention.fwd_kernel(causal="none", mask_kind="none", mask_row_broadcast=False, need_lse=True,
                                  interpret=True, desc="host")
    mod = launch.kernel_module(kernel, True)
    q = torch.randn(2, 3, 20, 32)
    d, nh = mod._descriptor(q, 16)
    assert not nh and d.block_shape == [1, 1, 16, 32] and list(d.shape) == [2, 3, 20, 32]
    out = attention.alloc_out(q, q)
    d, nh = mod._descriptor(out, 16)
    assert nh and d.block_shape == [1, 16, 32] and list(d.shape) == [2, 20, 96]
    fused = torch.randn(2, 20, 3, 3, 32)[:, :, 1].transpose(1, 2)  # k of a fused qkv
    d, nh = mod._descriptor(fused, 16)
    assert nh and list(d.shape) == [2, 20, 96] and list(d.strides) == [20 * 9 * 32, 9 * 32, 1]
    padded = torch.randn(2, 20, 3, 36)[..., :32].transpose(1, 2)  # heads not side by side
    d, nh = mod._descriptor(padded, 16)
    assert not nh and list(d.strides) == [20 * 3 * 36, 36, 3 * 36, 1]


@pytest.mark.parametrize("desc", DESC)
def test_padded_head_stride_layout(force, desc):
    # [B, N, H, 36] memory, head dim 32: heads not side by side (the host path's 4-D form with
    # strides out of order)
    force(desc)
    gen = torch.Generator().manual_seed(141)
    q, k, v = (torch.randn(2, 37, 3, 36, generator=gen)[..., :32].transpose(1, 2) for _ in range(3))
    assert attention.desc_mode(q, k, v, attention.alloc_out(q, v)) == desc
    _check(q, k, v, causal="bottom_right", grad=False)


@pytest.mark.parametrize("desc,causal,cfg", [("host", "none", (128, 64, 4, 2)), ("device", "top_left", (64, 64, 4, 3)),
                                             ("host", "top_left", (128, 128, 8, 3))])
def test_descriptor_kernels_compile_for_sm90(desc, causal, cfg):
    """Compiled for an H100 (sm90) without a GPU (launch.compiled_shared_memory, Triton's own
    compile): bf16, D=128, the descriptor tables' configs fit the 232448 bytes of shared memory
    (the host kernel with q in [B, H, N, D] memory and out in [B, N, H, D] memory)."""
    from triton.backends.compiler import GPUTarget

    bm, bn, w, stages = cfg
    kernel = attention.fwd_kernel(causal=causal, mask_kind="none", mask_row_broadcast=False, need_lse=True,
                                  interpret=False, desc=desc)
    mod = launch.kernel_module(kernel, False)
    b, h, n, d = 2, 4, 256, 128
    q = torch.empty(b, h, n, d, dtype=torch.bfloat16)
    out = torch.empty(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(b, h, n)
    kw = dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, BLOCK_DV=d, INPUT_PRECISION="ieee",
              DEFER_SCALE=True, ROW_BASE=0, num_warps=w, num_stages=stages)
    if desc == "host":
        (tq, q_nh), (tk, k_nh), (to, o_nh) = mod._descriptor(q, bm), mod._descriptor(q, bn), mod._descriptor(out, bm)
        assert (q_nh, k_nh, o_nh) == (False, False, True)
        ptrs = [tq, tk, tk, to]
        kw.update(Q_NH=q_nh, K_NH=k_nh, V_NH=k_nh, O_NH=o_nh)
    else:
        ptrs = [q, q, q, out]
    args = [*ptrs, lse, *q.stride(), *q.stride(), *q.stride(), *out.stride(), h, 1, n, n, 0, 0.125]
    need = launch.compiled_shared_memory(mod.attention_fwd_kernel, args, kw, GPUTarget("cuda", 90, 32))
    assert 0 < need <= 232448, need


@pytest.mark.parametrize("desc", ("none",) + DESC)
def test_a_full_tile_scored_minus_inf_by_an_infinite_key(force, desc):
    """An infinite key component makes a row score a whole full (unmasked, in-range) tile -inf:
    eager weighs those keys 0 and the row stays finite; the kernel must too (the -inf guard on
    the running max holds on full tiles, not only on boundary ones)."""
    force(desc)
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 200, 32), torch.randn(1, 2, 200, 32), torch.randn(1, 2, 200, 32)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[:, :, :64, 0] = float("-inf")  # the first key tiles (BLOCK_N <= 64) score -inf in every row
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.2, -1) @ v.double()
    assert not ref.isnan().any()
    with launch.poison_outputs():
        out, _ = attention.forward(q, k, v, scale=0.2, causal="none")
    assert (out.double() - ref).abs().max().item() < 1e-4
