"""Attention distillation with fuser: a student learns its last layer's attention pattern from a
frozen teacher (MiniLM-style), trained with ``torch.compile(..., backend="fuser")``.

    python examples/distill.py

Without a GPU it runs fuser's kernels in Triton's interpreter on the CPU
(``options={"fuser.interpret": True}``; slow, exact).

The loss is cross-entropy plus ``KL(P_teacher ‖ P_student)`` between the two models' causal
attention distributions, written the natural way (``F.kl_div`` of two ``log_softmax`` es with
``finfo.min`` masking). fuser fuses each model's attention and the attention-KL term: the KL
is computed streaming over key tiles, never materialising either N×N matrix. Teacher and
student differ in width and head dim; the student uses grouped-query attention.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

import fuser

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyGPT, repeat_kv  # noqa: E402


def attention_kl(q_t, k_t, q_s, k_s):
    """Mean over query rows of KL(softmax(q_t k_tᵀ/√d_t) ‖ softmax(q_s k_sᵀ/√d_s)), causal.
    q ``[B, H, T, d]``, k ``[B, Hkv, T, d]`` (GQA heads repeated here)."""
    t = q_t.shape[-2]
    hidden = torch.ones(t, t, dtype=torch.bool, device=q_t.device).triu(1)
    neg = torch.finfo(torch.float32).min
    k_t = repeat_kv(k_t, q_t.shape[1] // k_t.shape[1])
    k_s = repeat_kv(k_s, q_s.shape[1] // k_s.shape[1])
    s_t = (q_t @ k_t.transpose(-2, -1) / math.sqrt(q_t.shape[-1])).float().masked_fill(hidden, neg)
    s_s = (q_s @ k_s.transpose(-2, -1) / math.sqrt(q_s.shape[-1])).float().masked_fill(hidden, neg)
    kl = F.kl_div(F.log_softmax(s_s, -1), F.log_softmax(s_t, -1), reduction="none", log_target=True)
    return kl.masked_fill(hidden, 0.0).sum(-1).mean()


def make_step(teacher, student):
    def step(idx, target):
        with torch.no_grad():
            _, (q_t, k_t) = teacher(idx, return_qk=True)
        logits, (q_s, k_s) = student(idx, return_qk=True)
        ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        return ce + attention_kl(q_t, k_t, q_s, k_s)
    return step


def main() -> None:
    torch.manual_seed(0)
    if torch.cuda.is_available():
        device, dtype, seq, options = "cuda", torch.bfloat16, 1024, None
    else:
        device, dtype, seq = "cpu", torch.float32, 48
        options = {"fuser.interpret": True}
        print("No GPU found: asking fuser to run its Triton kernels in Triton's interpreter on the CPU "
              "(options={'fuser.interpret': True}; slow but exact; without it, regions on CPU tensors are "
              "left to Inductor).")
    teacher = TinyGPT(vocab=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, max_seq=seq).to(device, dtype).eval()
    student = TinyGPT(vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq=seq).to(device, dtype)
    for p in teacher.parameters():
        p.requires_grad_(False)
    idx = torch.randint(0, 256, (2, seq), device=device)
    target = torch.randint(0, 256, (2, seq), device=device)
    step = make_step(teacher, student)

    report = fuser.explain(step, idx, target, options=options)
    print(report)
    compiled = torch.compile(step, backend="fuser", options=options)

    def grads(fn):
        student.zero_grad(set_to_none=True)
        loss = fn(idx, target)
        loss.backward()
        return loss.detach(), [p.grad.detach().clone() for p in student.parameters()]

    loss_f, g_f = grads(compiled)
    loss_e, g_e = grads(step)
    worst = max(((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(g_f, g_e))
    print(f"\nloss fused {loss_f.item():.6f} vs eager {loss_e.item():.6f}; worst relative gradient difference {worst:.2e}")
    patterns = sorted(m.pattern for m in report.fused)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    if "attention_kl" not in patterns or worst > tol:
        raise SystemExit(f"distillation check failed: fused {patterns}, gradient difference {worst:.2e}")


if __name__ == "__main__":
    main()
