"""fuser.export: torch.export with fuser's ops in the exported program (CPU: the interpreter;
the AOTInductor package is a GPU test)."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import fuser
from fuser import report

INTERPRET = {"fuser.interpret": True}


class Block(torch.nn.Module):
    """Self-attention with its projections: q, k, v from one Linear, causal optional."""

    def __init__(self, dim: int = 32, heads: int = 2, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) * (C // self.heads) ** -0.5
        if self.causal:
            s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return self.out(o.transpose(1, 2).reshape(B, N, C))


def fuser_ops(ep) -> list:
    return [n.target for n in ep.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "fuser"]


def reference(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    model64 = Block(x.shape[-1], model.heads, model.causal).double()
    model64.load_state_dict(model.state_dict())
    with torch.no_grad():
        return model64(x.double())


@pytest.mark.parametrize("causal", [False, True])
def test_the_exported_program_holds_the_fused_op_and_equals_float64(causal):
    torch.manual_seed(0)
    model = Block(causal=causal)
    x = torch.randn(2, 45, 32)
    with report.collecting() as rep:
        ep = fuser.export(model, (x,), options=INTERPRET)
    assert fuser_ops(ep) == [torch.ops.fuser.attention.default]
    assert [m.pattern for m in rep.matches if m.fused] == ["attention"]
    got = ep.module()(x)
    torch.testing.assert_close(got.double(), reference(model, x), atol=2e-5, rtol=1e-4)


def test_dynamic_shapes_serve_other_lengths_and_survive_save_and_load():
    torch.manual_seed(1)
    model = Block()
    x = torch.randn(1, 40, 32)
    seq = torch.export.Dim("seq", min=2, max=512)
    ep = fuser.export(model, (x,), dynamic_shapes={"x": {1: seq}}, options=INTERPRET)
    assert fuser_ops(ep)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    for n in (3, 77):
        y = torch.randn(1, n, 32)
        got = loaded.module()(y)
        torch.testing.assert_close(got.double(), reference(model, y), atol=2e-5, rtol=1e-4)


def test_nothing_fused_returns_the_plain_export():
    model = torch.nn.Linear(8, 8)
    ep = fuser.export(model, (torch.randn(2, 8),), options=INTERPRET)
    assert not fuser_ops(ep)


def test_cpu_regions_are_left_alone_without_the_interpreter():
    with report.collecting() as rep:
        ep = fuser.export(Block(), (torch.randn(1, 16, 32),), options={"fuser.interpret": False})
    assert not fuser_ops(ep)
    assert rep.rejected and "interpret" in rep.rejected[0].reason


def test_for_aoti_refuses_ops_that_would_stay_opaque():
    x = torch.randn(1, 16, 32)
    with pytest.raises(fuser.FuserOptionError, match="CUDA"):
        fuser.export(Block(), (x,), options=INTERPRET, for_aoti=True)


def test_inductor_options_are_refused_with_where_they_belong():
    with pytest.raises(fuser.FuserOptionError, match="aoti_compile_and_package"):
        fuser.export(Block(), (torch.randn(1, 8, 32),), options={"max_autotune": True})
    with pytest.raises(fuser.FuserOptionError):
        fuser.export(Block(), (torch.randn(1, 8, 32),), options={"fuser.no_such_option": 1})


_RUN_PACKAGE = """
import sys, torch
import fuser  # noqa: F401  (not needed by a package whose ops became kernels; imported to be fair)
runner = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.load(sys.argv[2])
torch.save(runner(x), sys.argv[3])
"""


def run_package(path, x, tmp_path) -> "torch.Tensor | str":
    """Load and run an AOTInductor package in a fresh process (a loader crash must not take
    pytest down): its output, or the failure's text."""
    import subprocess
    import sys

    tmp_path.mkdir(parents=True, exist_ok=True)
    inp, out = tmp_path / "x.pt", tmp_path / "y.pt"
    torch.save(x, inp)
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _RUN_PACKAGE, str(path), str(inp), str(out)],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return f"exit code {p.returncode}: {p.stderr[-400:]}"
    return torch.load(out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_aoti_package_launches_our_kernels_and_equals_eager(tmp_path, dtype):
    torch.manual_seed(2)
    model = Block(dim=128, heads=2, causal=True).cuda().to(dtype)
    x = torch.randn(2, 333, 128, device="cuda", dtype=dtype)
    ep = fuser.export(model, (x,), for_aoti=True)
    assert fuser_ops(ep)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "block.pt2"))
    with zipfile.ZipFile(path) as z:
        sources = [z.read(n).decode() for n in z.namelist() if n.endswith(".cpp") or n.endswith(".json")]
    assert not any("fuser::" in w for w in sources), "a fused op stayed opaque in the package"
    assert any("attention_fwd_kernel" in w for w in sources), "the package does not launch fuser's kernel"

    y = torch.randn(2, 333, 128, device="cuda", dtype=dtype)
    got = run_package(path, y, tmp_path / "fused")
    if isinstance(got, str):
        # control: a package without fuser; if it cannot run either, the machine's AOTInductor cannot
        lin = torch.nn.Linear(16, 16).cuda()
        plain = torch._inductor.aoti_compile_and_package(
            torch.export.export(lin, (torch.randn(2, 16, device="cuda"),)), package_path=str(tmp_path / "plain.pt2"))
        control = run_package(plain, torch.randn(2, 16, device="cuda"), tmp_path / "plain")
        if isinstance(control, str):
            pytest.skip(f"AOTInductor packages do not load on this machine, a plain nn.Linear's neither "
                        f"({control.splitlines()[0] if control else control}); the package was built and holds "
                        f"fuser's kernel")
        pytest.fail(f"the fused package does not run while a plain one does: {got}")
    model64 = Block(128, 2, True).cuda().double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    with torch.no_grad():
        want = model64(y.double())
        eager = model(y).double()
    tol = (eager - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 3 * tol + 1e-3
