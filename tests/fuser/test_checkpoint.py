"""Matching inside higher-order-op bodies: activation checkpointing (full and selective),
``torch.compiler.nested_compile_region``, bodies fuser does not enter, and compiled autograd's
backward graph (passed through untouched).

Compiled runs use Triton's interpreter on CPU tensors (tests/conftest.py); each test compiles
one tiny model. Outputs and gradients are checked against eager float64.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fuser
from fuser import backend, names, passes, testing
from fuser.codegen import attention as attention_kernels
from fuser.codegen import launch

D, N, H = 16, 8, 2


def _core(q, k, v, causal):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


_core_region = torch.compiler.nested_compile_region(_core) if hasattr(torch.compiler, "nested_compile_region") else None


class Block(torch.nn.Module):
    """A tiny attention block: causal mask from a registered buffer; its attention core runs
    under ``torch.utils.checkpoint`` (``context_fn`` for selective checkpointing), or as a
    ``nested_compile_region``, or plainly."""

    def __init__(self, how: str = "checkpoint", context_fn=None, dim: int = D, heads: int = H, n: int = N):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.register_buffer("causal", torch.tril(torch.ones(n, n, dtype=torch.bool)))
        self.how, self.context_fn, self.dim, self.heads, self.n = how, context_fn, dim, heads, n

    def core(self, q, k, v):
        return _core(q, k, v, self.causal)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.how == "checkpoint":
            kw = {} if self.context_fn is None else {"context_fn": self.context_fn}
            o = checkpoint(self.core, q, k, v, use_reentrant=False, **kw)
        elif self.how.startswith("region"):
            # q, k, v as views of one buffer would be aliased inputs, which invoke_subgraph refuses
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            o = _core_region(q, k, v, self.causal)
            if self.how == "region_twice":
                o = o * _core_region(k, q, v, self.causal)
        else:
            o = self.core(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, n, d))


def _pair(block: Block) -> tuple[Block, Block, torch.Tensor, torch.Tensor]:
    """(float32 model, its float64 copy, x, x64)."""
    torch.manual_seed(0)
    ref = Block(block.how, block.context_fn, block.dim, block.heads, block.n).double()
    block.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in ref.state_dict().items()})
    x64 = torch.randn(2, block.n, block.dim, dtype=torch.float64, requires_grad=True)
    return block, ref, x64.detach().float().requires_grad_(), x64


def _check_training(out, model, x, ref, x64, tol: float = 5e-5) -> None:
    """``out`` (the compiled model's output on x) and the gradients of ``(out**2).sum()`` equal
    the float64 eager ones (float32 compiled: within ``tol``)."""
    want = ref(x64)
    (want ** 2).sum().backward()
    if x.grad is None:
        (out ** 2).sum().backward()
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=tol, rtol=tol)
    for (name, p), p64 in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), p64.grad, atol=tol, rtol=tol, msg=name)


@pytest.fixture
def launches(monkeypatch):
    """Counts the fused attention's forward and backward kernel launches (the ops' bodies run
    them at every call on CPU tensors; on the GPU only with the ops not inlined into Inductor)."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        orig = getattr(attention_kernels, name)

        def counting(*args, _orig=orig, _name=name, **kwargs):
            calls[_name] += 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(attention_kernels, name, counting)
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", False)
    return calls


def _policy_saving_fuser_ops(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in fuser.ops_to_save() else CheckpointPolicy.PREFER_RECOMPUTE


def _policy_recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


# -- the rewrite itself (no Inductor) ------------------------------------------------------------

def _body_targets(gm: torch.fx.GraphModule) -> list:
    """The call targets of every body GraphModule of ``gm``."""
    out = []
    for name, sub in gm.named_modules():
        if name and isinstance(sub, torch.fx.GraphModule):
            out += [n.target for n in sub.graph.nodes if n.op == "call_function"]
    return out


def test_checkpoint_body_is_rewritten_with_the_buffer_mask_proved_causal():
    model, _, x, _ = _pair(Block("checkpoint"))
    (gm, ex), = testing.capture(model, x)
    assert any(n.op == "call_function" and "tag_activation_checkpoint" in str(n.target) for n in gm.graph.nodes)
    gm, result = fuser.rewrite(gm, ex, options={"fuser.interpret": True}, grad_enabled=True)
    m, = result.matches
    assert m.fused and m.pattern == "attention"
    assert "inside torch.utils.checkpoint" in m.location
    # the mask is the registered buffer, seen through the checkpoint's operand: a static causal mask
    assert m.summary["causal"] == "top_left" and m.summary.get("assumes_constant")
    targets = _body_targets(gm)
    assert torch.ops.fuser.attention.default in targets and torch.softmax not in targets
    # the top-level graph still calls the checkpoint: the fused op runs inside it
    assert any("tag_activation_checkpoint" in str(n.target) for n in gm.graph.nodes)


def test_body_mask_without_the_callers_buffer_is_data():
    """Without Dynamo's source of the caller's operand the body's mask is an input (decided at
    run time), not a static causal mask: the source mapping is what proves it constant."""
    model, _, x, _ = _pair(Block("checkpoint"))
    (gm, ex), = testing.capture(model, x)
    for n in gm.graph.nodes:  # forget where the caller's inputs came from
        n.meta.pop("grapharg", None)
        n.meta.pop("fuser_source", None)
        if hasattr(n, "_dynamo_source"):
            del n._dynamo_source
    assert all(names.is_module_buffer(n) is None for n in gm.graph.nodes)
    _, result = fuser.rewrite(gm, ex, options={"fuser.interpret": True}, grad_enabled=True)
    assert all(m.summary.get("causal") != "top_left" for m in result.matches)


def test_ops_to_save_lists_the_fused_forward_ops():
    ops = fuser.ops_to_save()
    assert torch.ops.fuser.attention.default in ops and torch.ops.fuser.attention_kl.default in ops
    assert all(isinstance(op, torch._ops.OpOverload) and op.namespace == "fuser" for op in ops)
    names = [op.name() for op in ops]
    assert names == sorted(names)
    assert not any(n.endswith("_backward") for n in names), names
    assert torch.ops.fuser.saved_copy.default not in ops  # the pass's own helper, no fused forward


def test_unentered_hop_body_is_reported_not_rewritten():
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v

    def f(q, k, v, flag):
        return torch.cond(flag, attn, lambda q, k, v: v * 1.0, (q, k, v))

    q, k, v = (torch.randn(1, H, N, D) for _ in range(3))
    (gm, ex), = testing.capture(f, q, k, v, torch.tensor(True))
    before = {name: sub.code for name, sub in gm.named_modules() if isinstance(sub, torch.fx.GraphModule)}
    gm, result = fuser.rewrite(gm, ex, options={"fuser.interpret": True}, grad_enabled=False)
    # matched, not rewritten: every graph as it was
    assert {name: sub.code for name, sub in gm.named_modules() if isinstance(sub, torch.fx.GraphModule)} == before
    assert not result.matches
    r, = result.rejected
    assert r.pattern == "attention" and "torch.ops.higher_order.cond" in r.reason and "does not enter" in r.reason
    assert torch.ops.fuser.attention.default not in _body_targets(gm)


def test_invoke_subgraph_operands_are_unpacked_or_declined():
    """A body whose call passes another number of operands than it has inputs is not entered."""
    body = passes._Body(torch.fx.symbolic_trace(lambda a, b: a + b), "sub")
    graph = torch.fx.Graph()
    attr = graph.get_attr("sub")
    x = graph.placeholder("x")
    good = graph.call_function(torch.ops.higher_order.invoke_subgraph, (attr, "sub", x, x))
    packed = graph.call_function(torch.ops.higher_order.invoke_subgraph, (attr, "sub", (x, x)))
    body.uses = [(good, attr), (packed, attr)]
    call, per_call, why = passes._body_operands(body)
    assert call is passes.ENTERED_HOPS["invoke_subgraph"] and per_call == [[x, x], [x, x]] and not why
    short = graph.call_function(torch.ops.higher_order.invoke_subgraph, (attr, "sub", x))
    body.uses.append((short, attr))
    call, _, why = passes._body_operands(body)
    assert call is None and "do not line up" in why


# -- compiled, forward and backward --------------------------------------------------------------

def test_checkpointed_attention_is_fused_and_recomputed(launches):
    model, ref, x, x64 = _pair(Block("checkpoint"))
    rep = fuser.explain(model, x, options={"fuser.interpret": True})
    assert [m.pattern for m in rep.fused] == ["attention"], str(rep)
    assert "torch.utils.checkpoint" in rep.fused[0].location and "torch.utils.checkpoint" in str(rep)
    assert launches == {"forward": 1, "backward": 0}
    _check_training(rep.output, model, x, ref, x64)
    # checkpointing recomputes the fused forward in the backward instead of saving its output
    assert launches == {"forward": 2, "backward": 1}


@pytest.mark.parametrize("policy, forwards", [(_policy_saving_fuser_ops, 1), (_policy_recompute_all, 2)],
                         ids=["save_fuser_ops", "recompute_all"])
def test_selective_checkpoint_policy_decides_whether_the_fused_forward_is_saved(launches, policy, forwards):
    model, ref, x, x64 = _pair(Block("checkpoint", functools.partial(create_selective_checkpoint_contexts, policy)))
    rep = fuser.explain(model, x, options={"fuser.interpret": True})
    assert [m.pattern for m in rep.fused] == ["attention"], str(rep)
    _check_training(rep.output, model, x, ref, x64)
    assert launches == {"forward": forwards, "backward": 1}


def test_near_miss_inside_checkpoint_is_declined_with_its_reason():
    def body(q, k, v):
        p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        return p @ v, p

    def f(q, k, v):
        o, p = checkpoint(body, q, k, v, use_reentrant=False)
        return o.sum() + (p * p).sum()

    qkv64 = [torch.randn(1, H, N, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    qkv = [t.detach().float().requires_grad_() for t in qkv64]
    rep = fuser.explain(f, *qkv, options={"fuser.interpret": True})
    assert not rep.matches
    r, = rep.rejected
    assert r.pattern == "attention" and "inside torch.utils.checkpoint" in r.location
    assert "also used" in r.reason and "P materialised" in r.reason, r.reason
    rep.output.backward()
    f(*qkv64).backward()
    for t, t64 in zip(qkv, qkv64):
        torch.testing.assert_close(t.grad.double(), t64.grad, atol=5e-5, rtol=5e-5)


@pytest.mark.skipif(_core_region is None, reason="this torch has no torch.compiler.nested_compile_region")
def test_nested_compile_region_is_fused():
    """The region's body is rewritten; the rewritten graph, differentiated by AOTAutograd and
    run eagerly (``aot_eager``), trains as eager float64 does. (Not through Inductor: torch
    2.13's Inductor computes wrong gradients through ``invoke_subgraph`` on the CPU for this
    block with or without fuser, ``fuser.enabled=False`` too, while ``aot_eager`` is right.)"""
    from torch._dynamo.backends.debugging import aot_eager

    # torch 2.13 inlines a region called once before the backend sees it, unless told not to.
    # config.patch, not monkeypatch: pytest 9.2's monkeypatch deletes on undo an attribute that is
    # not in the module's __dict__, and a torch config module then loses the option for good
    patch = ({"inline_single_use_invoke_subgraph": False}
             if hasattr(torch._dynamo.config, "inline_single_use_invoke_subgraph") else {})
    model, ref, x, x64 = _pair(Block("region"))
    with torch._dynamo.config.patch(**patch):
        (gm, ex), = testing.capture(model, x)
    gm, result = fuser.rewrite(gm, ex, options={"fuser.interpret": True}, grad_enabled=True)
    m, = result.matches
    assert m.fused and "nested_compile_region" in m.location and m.summary["causal"] == "top_left"
    assert torch.ops.fuser.attention.default in _body_targets(gm)
    out, = aot_eager(gm, ex)(*ex)
    _check_training(out, model, x, ref, x64)


@pytest.mark.skipif(_core_region is None, reason="this torch has no torch.compiler.nested_compile_region")
def test_nested_compile_region_called_twice_is_fused_once(launches):
    """One body, two calls (with the operands swapped): rewritten once, both calls run the
    fused op. Inference only: in training, torch 2.13's Inductor computes wrong gradients for a
    region called twice on the CPU with or without fuser (``fuser.enabled=False`` too;
    ``aot_eager`` is right), which no test of fuser can hold."""
    model, ref, x, x64 = _pair(Block("region_twice"))
    with torch.no_grad():
        rep = fuser.explain(model, x, options={"fuser.interpret": True})
        want = ref(x64)
    assert [m.pattern for m in rep.fused] == ["attention"], str(rep)
    assert launches == {"forward": 2, "backward": 0}
    torch.testing.assert_close(rep.output.double(), want, atol=2e-5, rtol=2e-5)


def _training_step(model):
    """``x -> model(x)`` that also runs the backward of ``(out ** 2).sum()`` (compiled autograd
    compiles it when the step is compiled)."""
    def step(x):
        out = model(x)
        (out ** 2).sum().backward()
        return out

    return step


def test_compiled_autograd_backward_graph_passes_untouched(monkeypatch, launches):
    applied = []
    real_apply = passes.apply
    monkeypatch.setattr(passes, "apply", lambda gm, *a, **k: (applied.append(gm), real_apply(gm, *a, **k))[1])
    seen = []
    real_check = backend.compiled_autograd_graph
    monkeypatch.setattr(backend, "compiled_autograd_graph", lambda: (seen.append(real_check()), seen[-1])[1])
    model, ref, x, x64 = _pair(Block("checkpoint"))

    step = _training_step(model)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True), fuser.report.collecting() as rep:
        out = torch.compile(step, backend="fuser", options={"fuser.interpret": True})(x)
    # two graphs: the forward (fused) and compiled autograd's backward, which the pass never saw
    assert rep.graphs == 2 and seen == [False, True] and len(applied) == 1, (rep.graphs, seen)
    assert [m.pattern for m in rep.fused] == ["attention"] and not rep.rejected
    _check_training(out, model, x, ref, x64)
    assert launches == {"forward": 2, "backward": 1}


# -- GPU: what the lead runs on the device ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("policy", [None, _policy_saving_fuser_ops], ids=["full", "selective"])
def test_gpu_checkpoint_and_selective_checkpoint(monkeypatch, inline, policy):
    """Checkpointed attention on CUDA, with the fused ops inlined into Inductor and not: the
    same values as eager float64; not inlined, the forward runs twice under full checkpointing
    and once under the policy that saves fuser's ops."""
    calls = {"forward": 0}
    orig = attention_kernels.forward

    def counting(*args, **kwargs):
        calls["forward"] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "forward", counting)
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", inline)
    context_fn = None if policy is None else functools.partial(create_selective_checkpoint_contexts, policy)
    model, ref, x, x64 = _pair(Block("checkpoint", context_fn, dim=128, heads=2, n=64))
    model, ref, x, x64 = model.cuda(), ref.cuda(), x.detach().cuda().requires_grad_(), x64.detach().cuda().requires_grad_()
    rep = fuser.explain(model, x)
    assert [m.pattern for m in rep.fused] == ["attention"], str(rep)
    _check_training(rep.output, model, x, ref, x64, tol=1e-2)  # TF32 matmuls (Triton's fp32 dot default)
    if not inline:
        assert calls["forward"] == (2 if policy is None else 1)


@pytest.mark.gpu
def test_gpu_compiled_autograd_with_checkpoint():
    """Compiled autograd over a checkpointed block on CUDA (fused ops inlined into Inductor):
    the backward graph is compiled untouched, training equals eager float64."""
    model, ref, x, x64 = _pair(Block("checkpoint", None, dim=128, heads=2, n=64))
    model, ref, x, x64 = model.cuda(), ref.cuda(), x.detach().cuda().requires_grad_(), x64.detach().cuda().requires_grad_()

    step = _training_step(model)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True), fuser.report.collecting() as rep:
        out = torch.compile(step, backend="fuser")(x)
    _check_training(out, model, x, ref, x64, tol=1e-2)
    # the forward graph and compiled autograd's backward graph(s): torch 2.13 on the CPU makes one
    # backward graph, torch 2.11 on the H100 several (measured: 12 graphs in all); whatever their
    # number, only the forward's attention is fused
    assert rep.graphs >= 2 and [m.pattern for m in rep.fused] == ["attention"], str(rep)
