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
    assert sorted(m.graph_index for m in rep.fused) == [0, 1]  # numbered per report, from 0
    again = fuser.explain(broken, q, k, v)
    assert sorted(m.graph_index for m in again.fused) == [0, 1]
    assert "(graph 1)" in str(again) and "2 graphs" in str(again)


def test_disabled_compiles_like_inductor():
    q, k, v = _qkv()
    rep = fuser.explain(attn, q, k, v, options={"fuser.enabled": False})
    assert not rep.matches and rep.graphs == 1
    assert "fuser is disabled (fuser.enabled=False): nothing was matched" in str(rep)
    assert "fuser disabled" in repr(rep)
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
    assert backend._cache_key_pass(None).uuid() == f"fuser:{backend.source_hash()}|inline:1"


def test_cache_key_tells_inlined_from_opaque_ops(monkeypatch):
    # compiled code with fused ops inlined into Inductor must not be served to FUSER_OPAQUE_OPS=1
    inlined = backend._cache_key_pass(None).uuid()
    monkeypatch.setattr(launch, "INLINE_INTO_INDUCTOR", False)
    assert backend._cache_key_pass(None).uuid() != inlined


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


@pytest.mark.parametrize("options,message", [
    ({"fuser.patterns": 3}, "fuser.patterns takes a list"),
    ({"fuser.autotun": True}, "unknown fuser option 'fuser.autotun'"),
    ({"fuser.plan": "atention.backward=atomic_dq"}, "unknown pattern 'atention'"),
    ({"fuser.plan": {"attention.impl": "inductor"}}, "Inductor plans exist only on CUDA"),  # planner
])
def test_option_errors_reach_the_user_as_themselves(options, message):
    q, k, v = _qkv()
    torch._dynamo.reset()
    with pytest.raises(fuser.FuserOptionError, match=message) as info:
        torch.compile(attn, backend="fuser", options=options)(q, k, v)
    assert type(info.value) is fuser.FuserOptionError and isinstance(info.value, ValueError)
    assert "PyTorch" not in str(info.value)  # not Dynamo's "please report this to PyTorch"
    assert info.traceback[-1].path.name in ("options.py", "planner.py")
    assert not any(e.path.name == "output_graph.py" for e in info.traceback)  # Dynamo's frames cut


def test_explain_checks_options_before_compiling():
    calls = []

    def f(q, k, v):
        calls.append(1)
        return attn(q, k, v)

    with pytest.raises(fuser.FuserOptionError, match="attention has no choice 'bwd'"):
        fuser.explain(f, *_qkv(), options={"fuser.plan": {"attention.bwd": "atomic_dq"}})
    assert not calls


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget what fuser has said once in this process, and record every warning."""
    import warnings

    monkeypatch.setattr(backend, "_said", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def test_cpu_regions_go_to_inductor_unless_asked_and_it_is_said_once(monkeypatch, fresh_warnings):
    monkeypatch.delenv("FUSER_INTERPRET", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = _qkv()
    rep = fuser.explain(attn, q, k, v)
    assert not rep.fused and len(rep.rejected) == 1
    assert "fuser.interpret': True" in rep.rejected[0].reason
    assert torch.allclose(rep.output, attn(q, k, v), atol=1e-5)
    said = [w for w in fresh_warnings if issubclass(w.category, fuser.FuserWarning)]
    assert len(said) == 1
    text = str(said[0].message)
    assert "left to Inductor" in text and "options={'fuser.interpret': True}" in text and "FUSER_INTERPRET=1" in text
    fuser.explain(lambda q, k, v: attn(q, k, v) * 2, q, k, v)  # another compile: not said again
    assert len([w for w in fresh_warnings if issubclass(w.category, fuser.FuserWarning)]) == 1
    rep = fuser.explain(attn, q, k, v, options={"fuser.interpret": True})  # asked for: fused
    assert len(rep.fused) == 1


def _sdpa_causal(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _kl(q1, k1, q2, k2):
    ls = torch.nn.functional.log_softmax
    return torch.nn.functional.kl_div(ls(q2 @ k2.mT * 0.25, -1), ls(q1 @ k1.mT * 0.25, -1), reduction="batchmean",
                                      log_target=True)


def _h2o(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
    return p @ v, p.sum(-2)


def _kda(q, k, v, g, beta):
    b, h, t_len, kd = q.shape
    s = q.new_zeros(b, h, kd, v.shape[-1])
    o = torch.empty_like(v)
    for t in range(t_len):
        s = s * g[:, :, t][..., None].exp()
        v_hat = (k[:, :, t][..., None] * s).sum(-2)
        s = s + torch.einsum("bhk,bhv->bhkv", beta[:, :, t][..., None] * k[:, :, t], v[:, :, t] - v_hat)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t] * kd ** -0.5, s)
    return o, s


def _kda_inputs():
    q, k = (torch.nn.functional.normalize(torch.randn(1, 2, 5, 8), dim=-1) for _ in range(2))
    return [q, k, torch.randn(1, 2, 5, 6), -torch.nn.functional.softplus(torch.randn(1, 2, 5, 8)),
            torch.rand(1, 2, 5)]


@pytest.mark.parametrize("fn,make,pattern", [
    (_sdpa_causal, _qkv, "attention"),
    (_kl, lambda: [torch.randn(1, 2, 12, 16) for _ in range(4)], "attention_kl"),
    (_h2o, _qkv, "h2o"),
    (_kda, _kda_inputs, "kda"),
], ids=["sdpa", "attention_kl", "h2o", "kda"])
def test_every_pattern_leaves_cpu_regions_to_inductor_unless_the_interpreter_is_asked_for(
        monkeypatch, fresh_warnings, fn, make, pattern):
    """The device check is the pass's, not each pattern's: an SDPA call and a KDA loop on CPU
    tensors were once fused under the default ``fuser.interpret="auto"`` (their kernels ran in
    Triton's interpreter, seconds a call) without a word."""
    monkeypatch.delenv("FUSER_INTERPRET", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = make()
    rep = fuser.explain(fn, *args)
    assert not rep.fused, rep
    assert [r.pattern for r in rep.rejected] == [pattern]
    assert rep.rejected[0].reason == fuser.options.CPU_DECLINE
    want = fn(*args)
    for got, ref in zip(*(x if isinstance(x, tuple) else (x,) for x in (rep.output, want))):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    said = [str(w.message) for w in fresh_warnings if issubclass(w.category, fuser.FuserWarning)]
    assert len(said) == 1 and "left to Inductor" in said[0]
    rep = fuser.explain(fn, *args, options={"fuser.interpret": True})  # asked for: fused
    assert [m.pattern for m in rep.fused] == [pattern]


def test_cpu_decline_is_not_said_when_the_user_turned_the_interpreter_off(fresh_warnings):
    rep = fuser.explain(attn, *_qkv(), options={"fuser.interpret": False})
    assert not rep.fused and rep.rejected
    assert not [w for w in fresh_warnings if issubclass(w.category, fuser.FuserWarning)]


def test_triton_interpret_turns_the_interpreter_on(monkeypatch):
    monkeypatch.delenv("FUSER_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert len(fuser.explain(attn, *_qkv()).fused) == 1


def test_internal_error_while_emitting_is_warned_once_per_message(monkeypatch, fresh_warnings):
    from fuser.patterns import attention

    def broken(match, plan):
        raise OSError("cannot write the kernel file")

    monkeypatch.setattr(attention.PATTERN, "kernels", broken)
    q, k, v = _qkv()
    for _ in range(2):
        rep = fuser.explain(attn, q, k, v)
        assert not rep.fused and "internal error" in rep.rejected[0].reason
        assert torch.allclose(rep.output, attn(q, k, v), atol=1e-5)
    said = [str(w.message) for w in fresh_warnings if issubclass(w.category, fuser.FuserWarning)]
    assert len(said) == 1 and "internal error" in said[0] and "cannot write the kernel file" in said[0]


def test_debug_dir_applies_to_its_compile_only(tmp_path):
    import os

    d = tmp_path / "dbg"
    q, k, v = _qkv()
    rep = fuser.explain(attn, q, k, v, options={"fuser.debug_dir": str(d)})
    written = sorted(p.name for p in d.iterdir())
    assert written and written == sorted(os.path.basename(kk.path) for kk in rep.kernels)
    assert "FUSER_DEBUG_DIR" not in os.environ
    for p in d.iterdir():
        p.unlink()
    fuser.explain(attn, q, k, v)  # the same kernels, rendered again, without debug_dir
    assert not list(d.iterdir())


def test_debug_dir_that_is_a_file_is_an_option_error(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("")
    with pytest.raises(fuser.FuserOptionError, match="is not a directory"):
        fuser.explain(attn, *_qkv(), options={"fuser.debug_dir": str(f)})


def test_kernels_go_to_the_session_cache_not_the_users():
    import os

    rep = fuser.explain(attn, *_qkv())
    cache = os.path.realpath(os.environ["FUSER_CACHE_DIR"])
    assert "fuser-test-cache" in cache  # tests/conftest.py's temporary directory
    assert rep.kernels and all(os.path.realpath(kk.path).startswith(cache + os.sep) for kk in rep.kernels)



def _masked_attn(q, k, v, keep, bias):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")) + bias
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "declined"])
def test_the_backend_leaves_its_callers_frames_to_reference_counting(fused):
    """Nothing fuser keeps after compiling a graph holds the frames that called it.

    DDPOptimizer depends on this: it compiles each piece of a split graph from a frame
    (``run_node``) holding a guard whose ``__del__`` turns TracingContext.fakify_first_call off,
    trusting reference counting to run it when that frame returns. The static-mask evaluator
    once cached its NotStatic exceptions, each with a traceback reaching every calling frame,
    in a reference cycle; a collection during the next piece's compile then ran the old guard's
    ``__del__``, and the next piece's fake first call ran Inductor's code on fake tensors
    (CI, test_ddp_split_graph: FakeTensorDeviceMismatchError, meta and cpu). Dynamo collects
    after each compile, so the frame is checked here where DDPOptimizer's is: inside the
    compile, right after the backend returned, with the collector off."""
    import gc
    import weakref

    class Sentinel:  # a local of the frame that calls the backend, as DDPOptimizer's guard
        pass

    def compile_piece(gm, example_inputs):
        sentinel = Sentinel()
        compiled = backend.fuser_backend(gm, example_inputs, options={"fuser.interpret": True})
        return compiled, weakref.ref(sentinel)

    freed: list = []

    def caller_backend(gm, example_inputs):
        compiled, ref = compile_piece(gm, example_inputs)
        freed.append(ref() is None)
        return compiled

    q, k, v = _qkv()
    # an input mask and an input bias: the static-mask evaluator declines both (NotStatic);
    # a mask per head as well as per query is not one fuser reads (the region is declined)
    keep = torch.rand(1, 1, 12, 12) > 0.3 if fused else torch.rand(2, 2, 12, 12) > 0.3
    keep[..., 0] = True
    bias = torch.randn(12, 12)
    torch._dynamo.reset()
    compiled = torch.compile(_masked_attn, backend=caller_backend, fullgraph=True)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with fuser.report.collecting() as rep:
            out = compiled(q, k, v, keep, bias)
    finally:
        if was_enabled:
            gc.enable()
    assert freed == [True], "a compile left its caller's frame to the garbage collector"
    assert bool(rep.fused) == fused and bool(rep.rejected) != fused, (rep.fused, rep.rejected)
    torch.testing.assert_close(out, _masked_attn(q, k, v, keep, bias), atol=1e-5, rtol=1e-5)
