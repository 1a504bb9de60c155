"""The backend's contracts: registration, options, fullgraph, logging, the Inductor cache key,
autotuning's disk cache."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import fuser
from fuser import backend
from fuser.codegen import launch


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v


def _qkv():
    return [torch.randn(1, 2, 12, 16) for _ in range(3)]


def test_backend_registered_by_name():
    assert "fuser" in torch._dynamo.list_backends(exclude_tags=())


def test_backend_found_without_import_fuser():
    """Through the torch_dynamo_backends entry point (the package must be installed)."""
    from importlib.metadata import entry_points

    if not any(ep.name == "fuser" for ep in entry_points(group="torch_dynamo_backends")):
        pytest.skip("fuser is not installed (entry points come from the installed metadata)")
    code = textwrap.dedent("""
        import sys, torch
        f = torch.compile(lambda q, k, v: torch.softmax(q @ k.mT, -1) @ v, backend="fuser")
        q = torch.randn(1, 1, 8, 16)
        out = f(q, q, q)
        assert "fuser.patterns.attention" in sys.modules, "the fuser backend did not run"
        print("ok", tuple(out.shape))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok (1, 1, 8, 16)" in r.stdout, r.stderr[-3000:]


def test_fullgraph_and_graph_breaks():
    q, k, v = _qkv()
    torch._dynamo.reset()
    out = torch.compile(attn, backend="fuser", fullgraph=True)(q, k, v)
    assert torch.allclose(out, attn(q, k, v), atol=1e-5)

    def broken(q, k, v):
        a = attn(q, k, v)
        torch._dynamo.graph_break()
        return attn(a, k, v)

    rep = fuser.explain(broken, q, k, v)
    assert rep.graphs == 2 and len(rep.fused) == 2
    assert len({m.graph_index for m in rep.fused}) == 2


def test_disabled_compiles_like_inductor():
    q, k, v = _qkv()
    rep = fuser.explain(attn, q, k, v, options={"fuser.enabled": False})
    assert not rep.matches and rep.graphs == 1
    assert torch.allclose(rep.output, attn(q, k, v), atol=1e-5)


def test_inductor_options_and_mode_pass_through():
    q, k, v = _qkv()
    torch._dynamo.reset()
    out = torch.compile(attn, backend="fuser", mode="max-autotune-no-cudagraphs")(q, k, v)
    assert torch.allclose(out, attn(q, k, v), atol=1e-5)
    torch._dynamo.reset()
    out = torch.compile(attn, backend="fuser", options={"fuser.autotune": False, "max_autotune": False})(q, k, v)
    assert torch.allclose(out, attn(q, k, v), atol=1e-5)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="not_an_inductor_option"):
        torch.compile(attn, backend="fuser", options={"not_an_inductor_option": 1})(q, k, v)


def test_logging(caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="fuser"):
        fuser.explain(attn, q, k, v)
    text = caplog.text
    assert "fused attention" in text and "kernel attention_fwd" in text


def test_cache_key_pass_hashes_sources_and_composes():
    calls = []

    class UserPass(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "user-pass-v1"

    p = backend._cache_key_pass(UserPass())
    uuid = p.uuid()
    assert backend.source_hash() in uuid and "user-pass-v1" in uuid
    p(torch.fx.Graph())
    assert len(calls) == 1
    assert backend._cache_key_pass(None).uuid() == f"fuser:{backend.source_hash()}"


def test_autotune_times_once_and_caches_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_tune_mem", {})
    timings = {"a": 2.0, "b": 1.0, "c": 3.0}
    seen = []

    def fake_bench(fn, **kwargs):
        return fn()

    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)

    def run(cfg):
        seen.append(cfg["name"])
        if cfg["name"] == "c":
            raise RuntimeError("out of shared memory")
        return timings[cfg["name"]]

    cands = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    assert launch.autotune("k1", cands, run) == {"name": "b"}
    assert seen == ["a", "b", "c"]
    assert launch.autotune("k1", cands, run) == {"name": "b"} and len(seen) == 3  # memory
    monkeypatch.setattr(launch, "_tune_mem", {})
    assert launch.autotune("k1", cands, run) == {"name": "b"} and len(seen) == 3  # disk
    assert json.loads((tmp_path / "autotune.json").read_text())["k1"] == {"name": "b"}
