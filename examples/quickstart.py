"""fuser quickstart: compile a small GPT with ``backend="fuser"``, train one step, check it
against eager PyTorch, and show what was fused and where the generated Triton source lives.

    python examples/quickstart.py

Runs on a CUDA GPU when there is one; otherwise fuser runs its Triton kernels in Triton's
interpreter on the CPU (slow, exact — meant for trying fuser out and for tests).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import fuser

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import TinyGPT  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    if torch.cuda.is_available():
        device, dtype, seq = "cuda", torch.bfloat16, 1024
        print(f"GPU: {torch.cuda.get_device_name()}")
    else:
        device, dtype, seq = "cpu", torch.float32, 64
        print("No GPU found: fuser runs its Triton kernels in Triton's interpreter on the CPU "
              "(slow but exact).")
    model = TinyGPT(vocab=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq=seq).to(device, dtype)
    idx = torch.randint(0, 256, (2, seq), device=device)
    target = torch.randint(0, 256, (2, seq), device=device)

    # 1. What does fuser do with this model?
    report = fuser.explain(model, idx)
    print(report)

    # 2. One training step, compiled and eager, from the same weights.
    compiled = torch.compile(model, backend="fuser")

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(fn(idx).float().flatten(0, 1), target.flatten())
        loss.backward()
        return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]

    loss_f, grads_f = step(compiled)
    loss_e, grads_e = step(model)
    worst = max(((gf - ge).norm() / ge.norm().clamp_min(1e-12)).item() for gf, ge in zip(grads_f, grads_e))
    print(f"\nloss fused {loss_f.item():.6f} vs eager {loss_e.item():.6f}; "
          f"worst relative gradient difference {worst:.2e}")

    # 3. Where the Triton source is.
    print(f"\n{len(report.kernels)} kernel module(s) rendered; e.g. {report.kernels[0].path}:")
    print("\n".join(report.kernels[0].source.splitlines()[:12]) + "\n    ...")
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    if worst > tol or len(report.fused) != len(model.blocks):
        raise SystemExit(f"quickstart check failed: {len(report.fused)} fused region(s), gradient difference {worst:.2e}")


if __name__ == "__main__":
    main()
