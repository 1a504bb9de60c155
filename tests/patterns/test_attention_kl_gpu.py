"""Attention-KL through torch.compile on the GPU: the spellings at real sizes in bf16, fp16 and
fp32, loss and gradients against float64 eager on the same inputs, every plan, and the
distillation example. Marked ``gpu``: skipped without CUDA, run on the device machine."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fuser
from fuser.report import collecting

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# relative error bounds against float64 on the same inputs (fp32 dots are tf32-free "ieee")
LOSS_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def kl_log_target(q1, k1, q2, k2):
    s1 = q1 @ k1.transpose(-2, -1) / math.sqrt(q1.shape[-1])
    s2 = q2 @ k2.transpose(-2, -1) / math.sqrt(q2.shape[-1])
    return F.kl_div(F.log_softmax(s2.float(), -1), F.log_softmax(s1.float(), -1), reduction="batchmean",
                    log_target=True)


def kl_causal_finfo_min(q1, k1, q2, k2):
    s1 = (q1 @ k1.transpose(-2, -1)).float() * 0.1
    s2 = (q2 @ k2.transpose(-2, -1)).float() * 0.08
    n = s1.shape[-1]
    hidden = torch.ones(n, n, dtype=torch.bool, device=q1.device).triu(1)
    neg = torch.finfo(torch.float32).min
    kl = F.kl_div(F.log_softmax(s2.masked_fill(hidden, neg), -1), F.log_softmax(s1.masked_fill(hidden, neg), -1),
                  reduction="none", log_target=True)
    return kl.masked_fill(hidden, 0.0).sum(-1).mean()


def kl_bottom_right_inf_temperature(q1, k1, q2, k2, t=2.0):
    # fewer queries than keys (the last 300 queries of a longer cache), -inf, temperature, T^2
    q1, q2 = q1[:, :, -300:], q2[:, :, -300:]
    n_q, n_k = q1.shape[-2], k1.shape[-2]
    keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q1.device).tril(n_k - n_q)
    with torch.no_grad():
        p1 = F.softmax((q1 @ k1.transpose(-2, -1)).float().masked_fill(~keep, float("-inf")) / t, -1)
    logp2 = F.log_softmax((q2 @ k2.transpose(-2, -1)).float().masked_fill(~keep, float("-inf")) / t, -1)
    kl = torch.where(keep, p1 * (torch.log(p1) - logp2), 0.0)
    return kl.sum() * t ** 2


def kl_gqa_bnhd(q1, k1, q2, k2):
    # inputs [B, N, H, D]; the teacher has one kv head, the student two
    q1, q2 = q1.transpose(1, 2), q2.transpose(1, 2)
    h = q1.shape[1]
    k1 = k1.transpose(1, 2)[:, :1].repeat_interleave(h, dim=1)
    k2 = k2.transpose(1, 2)[:, :2].repeat_interleave(h // 2, dim=1)
    s1 = (q1 @ k1.transpose(-2, -1)).float() * 0.125
    s2 = (q2 @ k2.transpose(-2, -1)).float() * 0.125
    return (F.softmax(s1, -1) * (F.log_softmax(s1, -1) - F.log_softmax(s2, -1))).sum(-1).mean()


CASES = [
    ("log_target_batchmean", kl_log_target, (2, 4, 1000, 64, 96)),
    ("causal_finfo_min", kl_causal_finfo_min, (1, 4, 1500, 128, 128)),
    ("bottom_right_temperature", kl_bottom_right_inf_temperature, (2, 2, 1100, 64, 64)),
    ("gqa_bnhd", kl_gqa_bnhd, (2, 4, 777, 128, 64)),
]


def _inputs(shape, dtype, layout_bnhd, student_grad=True, teacher_grad=False, seed=0):
    b, h, n, d1, d2 = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def make(d, grad):
        dims = (b, n, h, d) if layout_bnhd else (b, h, n, d)
        return torch.randn(dims, device="cuda", dtype=dtype, generator=gen).requires_grad_(grad)

    return make(d1, teacher_grad), make(d1, teacher_grad), make(d2, student_grad), make(d2, student_grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name,fn,shape", CASES, ids=[c[0] for c in CASES])
def test_compiled_matches_float64(dtype, name, fn, shape):
    xs = _inputs(shape, dtype, name == "gqa_bnhd")
    torch._dynamo.reset()
    # fp32 dots run on CUDA cores ("ieee"): at these sizes the planner may leave fp32 to
    # Inductor's cuBLAS matmuls, so the kernels are forced there
    options = {"fuser.plan": "attention_kl.impl=fuser"} if dtype == torch.float32 else None
    with collecting() as rep:
        out = torch.compile(fn, backend="fuser", options=options)(*xs)
    assert [m.pattern for m in rep.fused] == ["attention_kl"], str(rep)
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in xs]
    ref = fn(*ref_in)
    assert torch.isfinite(out).all()
    assert abs(out.item() - ref.item()) <= LOSS_TOL[dtype] * abs(ref.item()), (out.item(), ref.item())
    want = torch.autograd.grad(ref, ref_in[2:])
    # fp16 gradients of a mean over many rows fall into fp16's subnormal range (~1e-6 and
    # below), where its relative precision is gone: scale the loss as fp16 training does, by a
    # power of two that brings the largest gradient near 1
    loss_scale = 1.0
    if dtype == torch.float16:
        loss_scale = 2.0 ** -math.ceil(math.log2(max(b.abs().max().item() for b in want)))
    got = torch.autograd.grad(out * loss_scale, xs[2:])
    for a, b in zip(got, (b * loss_scale for b in want)):
        assert a.dtype == dtype and not torch.isnan(a).any()
        assert _rel(a, b) < GRAD_TOL[dtype]


@pytest.mark.parametrize(
    "plan",
    ["attention_kl.backward=two_kernel", "attention_kl.backward=atomic_dq", "attention_kl.split_k=auto"],
)
@pytest.mark.parametrize("teacher_grad", [False, True], ids=["frozen", "trainable"])
def test_plans_agree_bf16(plan, teacher_grad):
    # B*H*Nq small enough that split_k=auto really splits (4 query blocks x 8 heads)
    xs = _inputs((1, 8, 500, 128, 128), torch.bfloat16, False, teacher_grad=teacher_grad, seed=1)
    torch._dynamo.reset()
    with collecting() as rep:
        out = torch.compile(kl_causal_finfo_min, backend="fuser", options={"fuser.plan": plan})(*xs)
    (m,) = rep.fused
    assert plan.split("=")[1] in m.plan.name, m.plan.name
    ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in xs]
    ref = kl_causal_finfo_min(*ref_in)
    assert abs(out.item() - ref.item()) <= 1e-2 * abs(ref.item())
    wrt = [i for i, x in enumerate(xs) if x.requires_grad]
    got = torch.autograd.grad(out, [xs[i] for i in wrt])
    want = torch.autograd.grad(ref, [ref_in[i] for i in wrt])
    for a, b in zip(got, want):
        assert not torch.isnan(a).any() and _rel(a, b) < 3e-2


def test_long_sequence_runs_in_linear_memory():
    # N = 16384, 4 heads: Inductor would need 4 GB per score matrix; fuser's workspace is O(N)
    xs = _inputs((1, 4, 16384, 128, 128), torch.bfloat16, False, seed=2)
    torch._dynamo.reset()
    f = torch.compile(kl_causal_finfo_min, backend="fuser")
    torch.autograd.grad(f(*xs), xs[2:])  # compile first: only a steady-state step is measured
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = f(*xs)
    grads = torch.autograd.grad(out, xs[2:])
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - sum(g.numel() * g.element_size() for g in grads)
    assert extra < 64 * 2**20, f"workspace {extra / 2**20:.1f} MiB"
    assert torch.isfinite(out) and all(not torch.isnan(g).any() for g in grads)


def test_cuda_graphs_mode_reduce_overhead(monkeypatch):
    # mode="reduce-overhead" records the step (fused ops included) in CUDA graphs: the small-N
    # remedy for host overhead. Replays must give the loss and gradients of the same plans run
    # without CUDA graphs: the planner plans for replays (launches cost no host time), so the
    # default mode may pick another backward, whose bfloat16 gradients differ in the last bit;
    # fuser.cuda_graphs=True plans as under CUDA graphs without capturing any, and the backward
    # is forced to the deterministic two-kernel one (atomic dQ sums in a varying order).
    xs = _inputs((1, 8, 1024, 64, 64), torch.bfloat16, False, seed=4)
    monkeypatch.setenv("FUSER_PLAN", "attention_kl.backward=two_kernel")  # both compiles (mode= takes no options=)
    torch._dynamo.reset()
    plain = torch.compile(kl_causal_finfo_min, backend="fuser", options={"fuser.cuda_graphs": True})
    want_loss = plain(*xs)
    want = torch.autograd.grad(want_loss, xs[2:])
    torch._dynamo.reset()
    graphed = torch.compile(kl_causal_finfo_min, backend="fuser", mode="reduce-overhead")
    for _ in range(4):  # warm-up, recording, replays
        torch.compiler.cudagraph_mark_step_begin()
        loss = graphed(*xs)
        got = [g.clone() for g in torch.autograd.grad(loss, xs[2:])]
        assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
        for a, b in zip(got, want):
            assert _rel(a, b) < 1e-5


def test_explain_names_the_plan():
    xs = _inputs((1, 16, 4096, 128, 128), torch.bfloat16, False, seed=3)
    rep = fuser.explain(kl_causal_finfo_min, *xs)
    (m,) = rep.fused
    assert m.pattern == "attention_kl" and m.plan.name.startswith("fuser["), str(rep)
    assert "attention_kl" in str(rep)


def test_distillation_example_runs_on_gpu():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "distill.py")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "attention_kl at distill.py" in r.stdout and "worst relative gradient difference" in r.stdout


def test_dynamic_lengths_launch_the_kernels_from_inductor():
    # a length marked dynamic (as after a recompile for a new length): the one-pass forward and the
    # two-kernel backward are traced with a symbolic N, launched by Inductor's wrapper (no opaque
    # fuser op in the code Inductor generates), and every length matches float64 from one graph;
    # traced at a multiple of 16, run at lengths that are not
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(kl_log_target, backend="fuser",
                      options={"fuser.plan": "attention_kl.split_k=1,attention_kl.backward=two_kernel"})
    codes = []
    for step, n in enumerate((256, 257, 1000)):
        torch.manual_seed(step)
        q1, k1 = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q2, k2 = (torch.randn(2, 4, n, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(2))
        if step == 0:
            for t in (q1, k1, q2, k2):
                torch._dynamo.mark_dynamic(t, 2)

        def run():
            loss = f(q1, k1, q2, k2)
            return loss, torch.autograd.grad(loss, (q2, k2))

        if step == 0:
            (loss, grads), got = run_and_get_code(run)
            codes += got
        else:
            loss, grads = run()
        ref_in = [x.detach().double().requires_grad_(x.requires_grad) for x in (q1, k1, q2, k2)]
        ref = kl_log_target(*ref_in)
        assert _rel(loss, ref) < LOSS_TOL[torch.bfloat16], n
        for a, b in zip(grads, torch.autograd.grad(ref, ref_in[2:])):
            assert _rel(a, b) < GRAD_TOL[torch.bfloat16], n
    code = "\n".join(codes)
    assert "torch.ops.fuser" not in code, code
    assert "def attention_kl_fwd" in code and "def attention_kl_bwd_dq" in code, code
    assert counters["stats"]["unique_graphs"] <= 1, dict(counters["stats"])
