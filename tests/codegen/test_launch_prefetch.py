"""The fit checks' compiles started ahead (``launch.prefetching``, ``launch.prefetch_compiles``,
``fuser.backend.prefetch_kernel_compiles``): a fused op's call traced as AOTAutograd will trace
it, forward and backward, starts every compile its fit checks will wait on, in the background,
and records, remembers and checks nothing; the traced run that follows compiles nothing more
and records the same launches. On the CPU: fake tensors on "meta" stand for an H100's, and
Triton compiles for sm90 (no GPU). On the GPU the backend's prefetch measured slower (first calls,
``benchmarks/results/first_step_ddp.md``), so it runs only with ``FUSER_PREFETCH=1``.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.fx as fx
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser import backend
from fuser.codegen import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patterns"))
from test_inline_ops import GPU, _an_h100  # noqa: E402,F401  (the H100 stand-in for traces on "meta")

H100_SHARED = 232448
PLAN = "backward=two_kernel;autotune=0"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty compile, fit and config memories (the on-disk shared-memory record too), and an
    H100's shared-memory limit on "meta"."""
    monkeypatch.setattr(launch, "shared_memory_limit", lambda device: H100_SHARED if device.type == GPU else None)
    monkeypatch.setattr(launch, "_shared_file", lambda: tmp_path / "shared_memory.json")
    for name in ("_fitting", "_checked", "_shared_needs"):
        monkeypatch.setattr(launch, name, {})


def _call(mask_kind):
    """(op, args) of a fused attention call on fake H100 tensors; q, k, v require grad."""
    mode = FakeTensorMode()
    with mode:
        q, k, v = (torch.empty(2, 4, 256, 64, dtype=torch.bfloat16, device=GPU, requires_grad=True) for _ in range(3))
        bias = torch.zeros(2, 1, 256, 256, dtype=torch.bfloat16, device=GPU) if mask_kind == "additive" else None
    op = torch.ops.fuser.attention.default
    args = (q, k, v, bias, 0.125, "none" if bias is not None else "top_left", mask_kind, True, PLAN, -math.inf,
            -math.inf, "replace", "", [], -math.inf, "replace")
    return mode, op, args


def _kernels_started():
    return sorted({k[0] for k in launch._shared_needs})


def _traced_launches(mode, op, args):
    """The kernel launches AOTAutograd's trace of forward and backward records (names, in order)."""
    def joint(q, k, v):
        out = op(q, k, v, *args[3:])[0]
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    with mode:
        gm = make_fx(dispatch_functionalize(joint))(*args[:3])
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    out = []
    for n in gm.graph.nodes:
        if "triton_kernel_wrapper" in str(n.target):
            kernel = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            cfg = [(c.kwargs, c.num_warps, c.num_stages) for c in getattr(kernel, "configs", ())[:1]]
            consts = sorted(kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"]).items(), key=str)
            out.append((kernel.fn.__name__, repr(consts), repr(cfg)))
    return out


@pytest.mark.parametrize("mask_kind", ["none", "additive"])
def test_prefetch_starts_the_forward_and_backward_compiles_and_remembers_nothing(fresh, mask_kind):
    mode, op, args = _call(mask_kind)
    assert launch.prefetch_compiles(op, args, {}, grad=True)
    started = dict(launch._shared_needs)
    # forward, dK/dV and dQ kernels (and the preprocess), each config the traced run may check
    assert len(started) >= 3
    assert launch._fitting == {} and launch._checked == {}
    needs = [f.result() for f in started.values()]
    assert all(isinstance(n, int) and n > 0 for n in needs), f"a compile failed: {needs}"
    # the forward's first two configs (the second is checked when the first does not fit)
    fwd = _fwd_kernel(mask_kind).cache_key
    assert sum(k[0] == fwd for k in started) == 2
    # the traced run compiles nothing more, and records the launches (kernels, constants,
    # configs) it records without the prefetch
    got = _traced_launches(mode, op, args)
    assert set(launch._shared_needs) == set(started)
    assert {"attention_fwd_kernel", "attention_bwd_dkdv", "attention_bwd_dq"} <= {g[0] for g in got}
    launch._fitting.clear()
    launch._checked.clear()
    launch._shared_needs.clear()
    assert _traced_launches(*_call(mask_kind)) == got


def test_without_grad_only_the_forward_is_started(fresh):
    mode, op, args = _call("none")
    assert launch.prefetch_compiles(op, args, {}, grad=False)
    names = {launch._binders[b][0].fn.__name__ for b in launch._binders
             if any(k[0] == launch._binders[b][0].cache_key for k in launch._shared_needs)}
    assert names == {"attention_fwd_kernel"}


def test_calls_that_stay_opaque_are_not_traced(fresh):
    with FakeTensorMode():
        q = torch.empty(1, 1, 16, 16, device="cpu")
    args = (q, q, q, None, 0.25, "top_left", "none", True, PLAN, -math.inf, -math.inf, "replace", "", [],
            -math.inf, "replace")
    assert not launch.prefetch_compiles(torch.ops.fuser.attention.default, args, {}, grad=True)
    assert not launch.prefetch_compiles(torch.ops.aten.add.Tensor, (q, q), {}, grad=True)
    assert launch._shared_needs == {}


@triton.jit
def _copy(X, Y, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i))


def test_a_failed_compile_is_raised_afresh_each_time(fresh, monkeypatch):
    """A compile that fails is kept as text and raised as a new KernelCompileError per ask: a
    kept exception would hold every frame it was raised through (see test_backend's frame test)."""
    monkeypatch.setattr(launch, "_compile_shared", lambda *a: ("CompilationError", "at 3:4: bad"))
    x = torch.empty(16, device="meta")
    errors = []
    for _ in range(2):
        with pytest.raises(launch.KernelCompileError, match="CompilationError: at 3:4: bad") as info:
            launch.compiled_shared_memory(_copy, (x, x), {"BLOCK": 16}, launch.compile_target(x.device))
        errors.append(info.value)
    assert errors[0] is not errors[1]
    # inside prefetching the same ask returns at once
    with launch.prefetching():
        assert launch.compiled_shared_memory(_copy, (x, x), {"BLOCK": 32}, launch.compile_target(x.device)) is None


def _fwd_kernel(mask_kind="none"):
    from fuser.codegen import attention

    causal = "none" if mask_kind != "none" else "top_left"
    return attention._fwd_module(causal, mask_kind, False, True, False)[1].attention_fwd_kernel


def test_the_backend_prefetches_the_fused_calls_of_its_graph(fresh):
    mode, op, args = _call("none")
    g = fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    for node, val in zip((q, k, v), args[:3]):
        node.meta["val"] = val
    out = g.call_function(op, (q, k, v, *args[3:]))
    g.output(out)
    assert backend.prefetch_kernel_compiles(fx.GraphModule(torch.nn.Module(), g), grad=True) == 1
    assert len(launch._shared_needs) >= 3
    del q.meta["val"]  # a call without example values is skipped
    q.meta.pop("example_value", None)
    launch._shared_needs.clear()
    assert backend.prefetch_kernel_compiles(fx.GraphModule(torch.nn.Module(), g), grad=True) == 0


def test_no_compile_threads_compiles_on_the_calling_thread_and_prefetches_nothing(fresh, monkeypatch):
    monkeypatch.setattr(launch, "COMPILE_THREADS", 0)
    mode, op, args = _call("none")
    assert not launch.prefetch_compiles(op, args, {}, grad=True)
    assert launch._shared_needs == {}
    x = torch.empty(16, device="meta")
    need = launch.compiled_shared_memory(_copy, (x, x), {"BLOCK": 16}, launch.compile_target(x.device))
    assert isinstance(need, int) and list(launch._shared_needs.values()) == [need]


@pytest.mark.parametrize("on", [False, True])
def test_the_backend_prefetches_only_when_asked(on, monkeypatch):
    """``FUSER_PREFETCH`` (``launch.PREFETCH``, off by default: it measured slower on the GPU)
    decides whether the backend walks a fused graph's calls before Inductor compiles it."""
    monkeypatch.setattr(launch, "PREFETCH", on)
    walked = []
    monkeypatch.setattr(backend, "prefetch_kernel_compiles", lambda gm, inputs=(), *, grad: walked.append(grad) or 0)

    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v

    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(attn, backend="fuser", options={"fuser.interpret": True})
    with fuser.report.collecting() as rep:
        torch.testing.assert_close(compiled(q, k, v), attn(q, k, v), rtol=1e-4, atol=1e-4)
    assert rep.fused, rep
    assert walked == ([True] if on else [])  # grad mode on (as in the caller)


def test_prefetch_is_off_unless_the_environment_asks():
    import subprocess

    code = "from fuser.codegen import launch; print(launch.PREFETCH)"
    env = {k: v for k, v in os.environ.items() if k != "FUSER_PREFETCH"}
    for value, expected in ((None, "False"), ("1", "True"), ("on", "True"), ("0", "False")):
        e = dict(env) if value is None else {**env, "FUSER_PREFETCH": value}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == expected, (value, out.stdout)
