"""Configs checked against the device's shared memory before a launch is made or recorded
(``launch.launch_first_fitting``, ``launch.check_fit``, ``launch.compiled_shared_memory``).

The selection logic with a fake compile step and limit (CPU); the real compile step for an sm90
target, which needs no GPU (Triton compiles to a cubin on the CPU), against the H100's limit; the
trace Inductor receives for the attention variant whose default config is too large; KDA's
backward offering fewer pipeline stages. Marked ``gpu``: the same through
``torch.compile(backend="fuser")`` on the device.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import pytest
import torch
import triton
import triton.language as tl
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from triton.backends.compiler import GPUTarget

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.codegen import attention, kda_bwd, launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patterns"))
from test_inline_ops import GPU, _an_h100  # noqa: E402,F401  (the H100 stand-in for traces on "meta")

#: An H100's opt-in shared memory per block (bytes): CUDA's cudaDevAttrMaxSharedMemoryPerBlockOptin.
H100_SHARED = 232448
SM90 = GPUTarget("cuda", 90, 32)


@triton.jit
def _tiles(X, Y, N, BLOCK: tl.constexpr):
    """Y = the sum over column offsets i of X_i @ X_i ([BLOCK, BLOCK] fp16 tiles, loaded through
    shared memory, pipelined over num_stages)."""
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    rows = tl.arange(0, BLOCK)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    for i in tl.range(0, N, BLOCK):
        x = tl.load(X + i + rows * N + cols)
        acc += tl.dot(x, x)
    tl.store(Y + rows * N + cols, acc)


def _cfg(block, stages):
    return {"BLOCK": block, "num_stages": stages}


class _Need:
    """A fake compile step: bytes = BLOCK² · 2 · num_stages, counting its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel, grid, args, kwargs, device):
        self.calls.append((kernel.fn.__name__, kwargs["BLOCK"], kwargs["num_stages"]))
        return kwargs["BLOCK"] ** 2 * 2 * kwargs["num_stages"]


def _limit(nbytes):
    return lambda device: nbytes


def _run_on(x, y):
    def run(cfg):
        launch.jit_call(_tiles)[(1,)](x, y, 64, BLOCK=cfg["BLOCK"], num_warps=4, num_stages=cfg["num_stages"])

    return run


def _traced(key, configs, need, limit):
    """Trace ``launch_first_fitting`` as AOTAutograd traces a fused op for Inductor (fake
    tensors, functionalised); the (BLOCK, num_stages) of each kernel launch in the graph."""
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(64, 64, dtype=torch.float16, device="meta")

    def body(x):
        y = torch.empty(64, 64, dtype=torch.float32, device=x.device)
        launch.launch_first_fitting(key, configs, _run_on(x, y), need=need, limit=limit)
        return y

    with mode:
        gm = make_fx(dispatch_functionalize(body))(x)
    return _launches(gm)


def _launches(gm, kernel_name=None):
    """The non-tensor arguments of each kernel launch in ``gm`` (of the kernel ``kernel_name``
    only, when given), with the ``num_warps`` and ``num_stages`` (wrap_triton keeps them as the
    one config of an autotuner)."""
    out = []
    for node in gm.graph.nodes:
        if "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            if kernel_name is not None and getattr(getattr(kernel, "fn", kernel), "__name__", None) != kernel_name:
                continue
            args = {k: v for k, v in node.kwargs["kwargs"].items() if not isinstance(v, torch.fx.Node)}
            args.update(kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
            for cfg in getattr(kernel, "configs", ())[:1]:
                args.update(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            out.append(args)
    return out


def test_first_fitting_config_is_recorded_under_tracing_and_remembered():
    configs = [_cfg(128, 3), _cfg(64, 3), _cfg(32, 2)]  # 98304, 24576, 4096 bytes
    need, limit = _Need(), _limit(50_000)
    got = _traced(("fit-trace",), configs, need, limit)
    assert [(c["BLOCK"], c["num_stages"]) for c in got] == [(64, 3)]
    assert need.calls == [("_tiles", 128, 3), ("_tiles", 64, 3)]  # the third config never compiled
    need.calls.clear()
    got = _traced(("fit-trace",), configs, need, limit)  # same key: remembered
    assert [(c["BLOCK"], c["num_stages"]) for c in got] == [(64, 3)] and need.calls == []
    with pytest.raises(launch.ConfigDoesNotFit):  # each checked config's answer is remembered too
        _traced(("fit-trace",), configs[:1], need, limit)
    assert need.calls == []
    got = _traced(("fit-trace",), configs[2:], need, limit)  # one never checked: compiled
    assert [(c["BLOCK"], c["num_stages"]) for c in got] == [(32, 2)] and need.calls == [("_tiles", 32, 2)]


def test_default_that_fits_is_compiled_once_and_recorded():
    need = _Need()
    got = _traced(("fit-default",), [_cfg(64, 2), _cfg(32, 2)], need, _limit(H100_SHARED))
    assert [(c["BLOCK"], c["num_stages"]) for c in got] == [(64, 2)]
    assert need.calls == [("_tiles", 64, 2)]


def test_no_config_fits_names_kernel_needs_and_limit():
    configs = [_cfg(128, 3), _cfg(64, 3)]
    with pytest.raises(launch.ConfigDoesNotFit) as err:
        _traced(("fit-none",), configs, _Need(), _limit(20_000))
    msg = str(err.value)
    assert "_tiles" in msg and "98304 bytes" in msg and "24576 bytes" in msg and "20000 bytes" in msg
    assert "none of the 2 configs" in msg
    assert err.value.limit == 20_000 and [n for _, _, n in err.value.needs] == [98304, 24576]
    assert ("fit-none",) not in launch._fitting


def test_explicit_config_that_does_not_fit_raises():
    with pytest.raises(launch.ConfigDoesNotFit, match="the given config does not fit") as err:
        _traced(("fit-explicit",), [_cfg(128, 2)], _Need(), _limit(H100_SHARED // 4))
    assert f"{H100_SHARED // 4} bytes" in str(err.value) and "65536 bytes" in str(err.value)


def test_eager_launches_the_first_fitting_config():
    launched = []

    class Kernel:  # stands for a @triton.jit kernel: records its real launches
        fn = _tiles.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((kwargs["BLOCK"], kwargs["num_stages"]))

    kernel, x = Kernel(), torch.zeros(4)

    def run(cfg):
        launch.jit_call(kernel)[(1,)](x, BLOCK=cfg["BLOCK"], num_warps=4, num_stages=cfg["num_stages"])

    need = _Need()
    launch.launch_first_fitting(("fit-eager",), [_cfg(128, 4), _cfg(128, 2), _cfg(64, 2)], run, need=need,
                                limit=_limit(100_000))
    assert launched == [(128, 2)]  # the dry runs launch nothing
    assert [c[1:] for c in need.calls] == [(128, 4), (128, 2)]


def test_cpu_tensors_are_not_compiled():
    """The interpreter has no shared memory limit: the first config runs, nothing is compiled."""
    launched, need = [], _Need()

    class Kernel:
        fn = _tiles.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["BLOCK"])

    kernel, x = Kernel(), torch.zeros(4)

    def run(cfg):
        launch.jit_call(kernel)[(1,)](x, BLOCK=cfg["BLOCK"], num_stages=cfg["num_stages"])

    launch.launch_first_fitting(("fit-cpu",), [_cfg(256, 4), _cfg(16, 1)], run, need=need)
    assert need.calls == [] and launched == [256]


def test_a_failing_compile_step_leaves_the_config_unchecked(caplog):
    def broken(kernel, grid, args, kwargs, device):
        raise AttributeError("no such Triton API")

    with caplog.at_level(logging.WARNING, logger="fuser"):
        got = _traced(("fit-broken",), [_cfg(128, 3), _cfg(64, 3)], broken, _limit(1))
    assert [(c["BLOCK"], c["num_stages"]) for c in got] == [(128, 3)]
    assert "cannot tell how much shared memory kernel _tiles needs" in caplog.text


class OutOfResources(Exception):
    """Stands for Triton's (matched by name, as launch_first_fitting does)."""


def _failing_below(n_fit: int, what: str):
    """``(run, tried)``: ``run(cfg)`` launches a stand-in kernel through ``launch.jit_call`` that
    raises OutOfResources(``what``) when ``cfg["n"] < n_fit``; ``tried`` lists the ``n`` launched."""
    tried = []

    class Kernel:  # stands for a @triton.jit kernel
        fn = _tiles.fn

        def __getitem__(self, grid):
            def go(x, n):
                tried.append(n)
                if n < n_fit:
                    raise OutOfResources(what)
            return go

    kernel, x = Kernel(), torch.zeros(1)

    def run(cfg):
        launch.jit_call(kernel)[(1,)](x, n=cfg["n"])

    return run, tried


def test_out_of_resources_at_launch_still_moves_on():
    """A resource the check does not cover (threads, registers): Triton's OutOfResources when
    the op runs moves on to the next config, remembered for the key."""
    run, tried = _failing_below(2, "registers")
    configs = [{"n": 0}, {"n": 1}, {"n": 2}]
    launch.launch_first_fitting(("fit-oor",), configs, run, need=lambda *a: 0, limit=_limit(1))
    assert tried == [0, 1, 2] and launch._fitting[("fit-oor",)] == {"n": 2}


def test_default_config_falls_back_when_out_of_resources():
    """Triton's OutOfResources at launch (what the up-front shared-memory check cannot see; CPU
    tensors: nothing is checked up front) moves on to the next config."""
    run, tried = _failing_below(2, "shared memory")
    configs = [{"n": 0}, {"n": 1}, {"n": 2}, {"n": 3}]
    launch.launch_first_fitting(("test-key",), configs, run)
    assert tried == [0, 1, 2]
    tried.clear()
    launch.launch_first_fitting(("test-key",), configs, run)  # remembered
    assert tried == [2]
    with pytest.raises(OutOfResources):  # an explicit config is not replaced
        launch.launch_first_fitting(("other-key",), [{"n": 0}], run)
    with pytest.raises(ValueError):  # other errors are not retried
        launch.launch_first_fitting(("third-key",), configs, lambda cfg: (_ for _ in ()).throw(ValueError()))


# ---------------------------------------------------------------------------------------------
# The real compile step: Triton compiles for an sm90 target on the CPU (no GPU, no launch).
# ---------------------------------------------------------------------------------------------


def test_compiled_shared_memory_grows_with_tiles_and_stages():
    x, y = torch.empty(64, 64, dtype=torch.float16, device="meta"), torch.empty(64, 64, device="meta")
    need = {c: launch.compiled_shared_memory(_tiles, (x, y, 64), {"BLOCK": c[0], "num_warps": 4, "num_stages": c[1]},
                                             SM90)
            for c in ((64, 2), (64, 3), (128, 3))}
    # a pipelined fp16 [BLOCK, BLOCK] tile per stage at least
    assert need[(64, 2)] >= 64 * 64 * 2
    assert need[(64, 2)] < need[(64, 3)] < need[(128, 3)]
    assert need[(128, 3)] >= 128 * 128 * 2 * 2


def test_the_fit_check_lowers_to_llvm_only_and_reads_what_a_full_compile_reads(monkeypatch, tmp_path):
    """The fit check's compile stops after LLVM IR (where Triton has allocated shared memory):
    the same ``metadata.shared`` as ``triton.compile``'s full compile, nothing in Triton's cache
    (Inductor's compile of its own copy of the kernel is the one that launches: Triton keys its
    cache on a kernel's first line number too, so a full compile here was always a second one)."""
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    from fuser.codegen.launch import _compile_shared, _mock_args

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    x, y = torch.empty(64, 64, dtype=torch.float16, device="meta"), torch.empty(64, 64, device="meta")
    for block, stages in ((32, 2), (64, 3)):
        kw = {"BLOCK": block, "num_warps": 4, "num_stages": stages}
        backend = triton.compiler.make_backend(SM90)
        binder = create_function_from_signature(_tiles.signature, _tiles.params, backend)
        margs, mkw = _mock_args((x, y, 64)), dict(zip(kw, _mock_args(kw.values())))
        bound, spec, options = binder(*margs, **mkw)
        opts, sig, constexprs, attrs = _tiles._pack_args(backend, mkw, bound, spec, options)
        before = sorted(cache.rglob("*")) if cache.exists() else []
        part = _compile_shared(_tiles, sig, constexprs, attrs, SM90, dict(opts.__dict__))
        assert isinstance(part, int) and part >= block * block * 2
        assert (sorted(cache.rglob("*")) if cache.exists() else []) == before, "the fit check wrote into Triton's cache"
        full = triton.compile(ASTSource(_tiles, sig, constexprs, attrs), target=SM90, options=dict(opts.__dict__))
        assert part == full.metadata.shared


def test_a_failed_partial_compile_falls_back_to_a_full_one(monkeypatch, tmp_path):
    """Triton's pipeline not as the partial compile expects (here: no stage of the name it
    stops at, so no ``metadata["shared"]``): the full compile gives the same bytes."""
    monkeypatch.setattr(launch, "_shared_file", lambda: tmp_path / "shared_memory.json")
    x, y = torch.empty(64, 64, dtype=torch.float16, device="meta"), torch.empty(64, 64, device="meta")
    kw = {"BLOCK": 64, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(launch, "_shared_needs", {})
    want = launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90)
    monkeypatch.setattr(launch, "_shared_needs", {})
    monkeypatch.setattr(launch, "_shared_file", lambda: tmp_path / "other.json")
    monkeypatch.setattr(launch, "SHARED_MEMORY_STAGE", "no-such-stage")
    full = []
    real = triton.compiler.compile
    monkeypatch.setattr(triton.compiler, "compile", lambda *a, **k: full.append(a) or real(*a, **k))
    assert launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90) == want and len(full) == 1


def test_a_later_process_reads_the_fit_checks_bytes_from_disk(monkeypatch, tmp_path):
    """``<cache>/shared_memory.json`` keeps the bytes: with the in-memory record gone (a new
    process) the same ask compiles nothing; another config, or another Triton, is compiled."""
    monkeypatch.setattr(launch, "_shared_file", lambda: tmp_path / "shared_memory.json")
    monkeypatch.setattr(launch, "_shared_needs", {})
    x, y = torch.empty(64, 64, dtype=torch.float16, device="meta"), torch.empty(64, 64, device="meta")
    kw = {"BLOCK": 32, "num_warps": 4, "num_stages": 2}
    need = launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90)
    assert list(json.loads((tmp_path / "shared_memory.json").read_text()).values()) == [need]

    compiled = []
    real = launch._compile_shared
    monkeypatch.setattr(launch, "_compile_shared", lambda *a: compiled.append(a) or real(*a))
    monkeypatch.setattr(launch, "_shared_needs", {})
    assert launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90) == need and compiled == []
    assert launch.compiled_shared_memory(_tiles, (x, y, 64), dict(kw, BLOCK=128), SM90) > need
    assert len(compiled) == 1
    monkeypatch.setattr(triton, "__version__", triton.__version__ + ".other")
    monkeypatch.setattr(launch, "_shared_needs", {})
    assert launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90) == need and len(compiled) == 2
    # an environment variable Triton keys its own cache on (it can change what is compiled)
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")
    monkeypatch.setattr(launch, "_shared_needs", {})
    assert launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90) == need and len(compiled) == 3


def test_fit_check_stats_count_where_each_answer_came_from(monkeypatch, tmp_path):
    """``launch.fit_check_stats()``: asks, answers from memory and from disk, compiles, and the
    seconds the caller waited (a compile's time on the calling thread, not a disk read's)."""
    monkeypatch.setattr(launch, "_shared_file", lambda: tmp_path / "shared_memory.json")
    monkeypatch.setattr(launch, "_shared_needs", {})
    x, y = torch.empty(64, 64, dtype=torch.float16, device="meta"), torch.empty(64, 64, device="meta")
    kw = {"BLOCK": 32, "num_warps": 4, "num_stages": 2}

    def delta(before):
        after = launch.fit_check_stats()
        return {k: after[k] - before[k] for k in after}

    s0 = launch.fit_check_stats()
    launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90)
    d = delta(s0)
    assert (d["asked"], d["memory"], d["disk"], d["compiles"]) == (1, 0, 0, 1) and d["wait_s"] > 0
    s1 = launch.fit_check_stats()
    launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90)
    assert {k: v for k, v in delta(s1).items()} == {"asked": 1, "memory": 1, "disk": 0, "compiles": 0, "wait_s": 0}
    monkeypatch.setattr(launch, "_shared_needs", {})
    s2 = launch.fit_check_stats()
    launch.compiled_shared_memory(_tiles, (x, y, 64), kw, SM90)
    assert delta(s2) == {"asked": 1, "memory": 0, "disk": 1, "compiles": 0, "wait_s": 0}


def _attention_fwd_launch(d, dtype, mask_kind="additive"):
    """``run(config)`` of the attention forward's GPU kernel on meta tensors (B=2, H=4, N=1024)."""
    _, module = attention._fwd_module("none", mask_kind, False, True, False)
    b, h, n = 2, 4, 1024
    q, k, v, out = (torch.empty(b, h, n, d, dtype=dtype, device="meta") for _ in range(4))
    stats = torch.empty(b, h, 2, n, device="meta")
    mask = torch.empty(b, h, n, n, dtype=dtype, device="meta")

    # a full data mask without causal masking: the kernel reads the run-time skip flag
    # (attention.mask_tiles_skippable; any value: only the compile is asked for here)
    extra = {"skip_hidden": torch.empty((), dtype=torch.int32, device="meta")} \
        if attention.mask_skips("none", mask_kind, False, None) else {}

    def run(cfg):
        module.launch_fwd(q, k, v, out, stats, mask, qk_scale=0.125 * attention.LOG2E, causal_offset=0, config=cfg,
                          input_precision="ieee", **extra)

    return run


def _sm90_need(kernel, grid, args, kwargs, device):
    return launch.compiled_shared_memory(kernel, args, kwargs, SM90)


def test_attention_additive_default_config_does_not_fit_an_h100():
    """The largest default: D=128 bf16 with an additive mask, a [BLOCK_M, BLOCK_N] bias tile per
    stage besides K and V: too large for an H100; the next config of the table fits."""
    table = attention._FWD_TABLE[("sm90", 128, 2)]
    run = _attention_fwd_launch(128, torch.bfloat16)
    first = launch.check_fit(run, table[0], need=_sm90_need, limit=_limit(H100_SHARED))
    assert first.checked and not first.ok and first.kernel == "attention_fwd_kernel"
    assert first.need > H100_SHARED and first.limit == H100_SHARED
    second = launch.check_fit(run, table[1], need=_sm90_need, limit=_limit(H100_SHARED))
    assert second.checked and second.ok


def test_traced_attention_records_a_config_that_fits(monkeypatch):
    """The fused op as Inductor receives it (fake H100 tensors on "meta", functionalised): the
    forward's launch carries the first table config that fits, not the default."""
    monkeypatch.setattr(launch, "shared_memory_limit", lambda device: H100_SHARED if device.type == GPU else None)
    monkeypatch.setattr(launch, "_fitting", {})
    table = attention._FWD_TABLE[("sm90", 128, 2)]
    run = _attention_fwd_launch(128, torch.bfloat16)
    fitting = next(c for c in table if launch.check_fit(run, c, need=_sm90_need, limit=_limit(H100_SHARED)).ok)
    assert fitting != table[0]
    mode = FakeTensorMode()
    with mode:
        q, k, v = (torch.empty(2, 4, 256, 128, dtype=torch.bfloat16, device=GPU) for _ in range(3))
        bias = torch.empty(2, 1, 256, 256, dtype=torch.bfloat16, device=GPU)
        gm = make_fx(dispatch_functionalize(
            lambda *xs: torch.ops.fuser.attention.default(*xs, 0.125, "none", "additive", True,
                                                          "backward=two_kernel;autotune=0", -math.inf, -math.inf,
                                                          "replace", "", [], -math.inf, "replace")))(q, k, v, bias)
    # (the mask-rows kernel of the run-time skip test launches too, with its own fixed config)
    got = [(c["BLOCK_M"], c["BLOCK_N"]) for c in _launches(gm, "attention_fwd_kernel")]
    assert got == [(fitting["BLOCK_M"], fitting["BLOCK_N"])]
    assert len(_launches(gm, "attention_mask_rows_kernel")) == 1


def test_kda_backward_offers_fewer_stages(monkeypatch):
    """``kda_bwd._launch``: the requested stage count, else fewer, the first that fits."""
    launched = []

    class Kernel:
        fn = _tiles.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["num_stages"])

    def need(kernel, grid, args, kwargs, device):
        return 40_000 * kwargs["num_stages"]

    x = torch.zeros(8)
    monkeypatch.setattr(launch, "shared_memory_need", need)
    monkeypatch.setattr(launch, "shared_memory_limit", _limit(100_000))
    kda_bwd._launch(Kernel(), (1,), (x,), {"BK": 32, "num_warps": 4}, 4)
    assert launched == [2]
    monkeypatch.setattr(launch, "shared_memory_limit", _limit(30_000))
    with pytest.raises(launch.ConfigDoesNotFit, match="40000 bytes"):
        kda_bwd._launch(Kernel(), (1,), (x,), {"BK": 64, "num_warps": 4}, 1)
    monkeypatch.setattr(launch, "shared_memory_limit", _limit(1_000_000))
    kda_bwd._launch(Kernel(), (1,), (x.double(),), {"BK": 32, "num_warps": 4}, 4)
    assert launched == [2, 4]  # another dtype: checked anew
    kda_bwd._launch(Kernel(), (1,), (x,), {"BK": 32, "num_warps": 4}, 4)
    assert launched == [2, 4, 2]  # remembered for the first: not checked again


# ---------------------------------------------------------------------------------------------
# On the device
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_limit_is_tritons():
    from triton.runtime import driver

    dev = torch.device("cuda", torch.cuda.current_device())
    assert launch.shared_memory_limit(dev) == driver.active.utils.get_device_properties(dev.index)["max_shared_mem"]


@pytest.mark.gpu
def test_eager_and_traced_compiles_agree():
    """Triton's warmup (the launch path) and the compile for the device's target agree."""
    x, y = torch.zeros(256, 256, dtype=torch.float16, device="cuda"), torch.zeros(256, 256, device="cuda")
    kw = {"BLOCK": 128, "num_warps": 4, "num_stages": 3}
    eager = launch.shared_memory_need(_tiles, (1,), (x, y, 256), kw, x.device)
    traced = launch.compiled_shared_memory(_tiles, (x, y, 256), kw, launch.compile_target(x.device))
    assert eager == traced > 0


_ONE_COMPILE = r"""
import json, pathlib, sys, torch
import fuser  # noqa: F401  (registers the backend)
q, k, v = (torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
f = torch.compile(lambda q, k, v: torch.softmax(q @ k.mT * 0.125, -1) @ v, backend="fuser",
                  options={"fuser.plan": "attention.impl=fuser"})
f(q, k, v).sum().backward()
torch.cuda.synchronize()
entries = {}
for js in pathlib.Path(sys.argv[1]).glob("*/*.json"):
    m = json.loads(js.read_text())
    if "name" in m and m["name"].startswith("attention_"):
        entries.setdefault(m["name"], []).append([m.get("num_warps"), m.get("num_stages"), m.get("debug")])
print(json.dumps(entries))
"""


@pytest.mark.gpu
def test_each_fused_kernel_is_compiled_once_on_a_cold_cache(tmp_path):
    """A fresh process, empty caches: a fused attention's forward and backward kernels are each
    compiled once per config, by Inductor (the fit check lowers to LLVM IR only and writes
    nothing into Triton's cache; its full compile was always a second one, Triton keying its
    cache on the kernel's first line number, which differs in Inductor's copy)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"),
               FUSER_CACHE_DIR=str(tmp_path / "fuser"))
    res = subprocess.run([sys.executable, "-c", _ONE_COMPILE, str(tmp_path / "triton")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    entries = json.loads(res.stdout.strip().splitlines()[-1])
    assert any(name.startswith("attention_fwd") for name in entries), entries
    for name, compiled in entries.items():
        assert len(compiled) == len({tuple(c[:2]) for c in compiled}), f"{name} compiled more than once: {compiled}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_compiled_attention_with_additive_mask_matches_eager(d):
    """The variant whose default config is the largest (D=128 bf16 with an additive mask: its
    default does not fit an H100) compiles through Inductor with a config that fits and matches
    eager (it failed at the compiled program's first call when the default was recorded as is)."""
    from fuser.report import collecting

    torch.manual_seed(0)
    b, h, n = 2, 8, 1024
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bias = torch.randn(b, 1, n, n, device="cuda", dtype=torch.bfloat16)

    def f(q, k, v, bias):
        s = q @ k.transpose(-2, -1) / math.sqrt(d) + bias
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    torch._dynamo.reset()
    with collecting() as rep:
        out = torch.compile(f, backend="fuser", options={"fuser.plan": "attention.impl=fuser"})(q, k, v, bias)
    assert len(rep.fused) == 1, str(rep)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = f(*ref_in, bias.double())
    rel = lambda a, r: ((a.double() - r).norm() / r.norm()).item()  # noqa: E731
    assert rel(out, ref) < 2e-2
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g.to(out.dtype)), torch.autograd.grad(ref, ref_in, g)):
        assert not torch.isnan(a).any() and rel(a, r) < 3e-2
    table = attention.candidate_configs(head_dim=d, head_dim_v=d, dtype=torch.bfloat16, device=q.device)
    chosen = [cfg for key, cfg in launch._fitting.items()
              if isinstance(key[0], str) and "attention_fwd_maskadd" in key[0] and key[1] == "fwd" and key[3] == d]
    assert chosen and all(c in table for c in chosen)
    if d == 128 and launch.device_kind(q.device) == "sm90" and launch.shared_memory_limit(q.device) <= H100_SHARED:
        assert table[0] not in chosen  # the default needs 294912 bytes (compiled for sm90 with Triton 3.6 / 3.9)


@pytest.mark.parametrize("k_dim", [64, 128, 256])
@pytest.mark.parametrize("output_precision", ["tf32", "tf32x3"])
def test_kda_chunk_table_has_a_config_that_fits_an_h100(k_dim, output_precision, monkeypatch):
    """The chunked KDA forward's sm90 table, float32 dots, bf16 inputs: some config of each K
    bucket fits an H100 with either output-path precision (single-pass TF32 at K=256 needs the
    table's one-stage config: two stages stage 317-352 KB of state blocks), compiled for sm90."""
    from fuser.codegen import kda_chunk

    offered = []

    def first_fitting(key, configs, run, **kw):  # as launch_first_fitting: in order, to the first that fits
        fits = []
        for c in configs:
            fits.append(launch.check_fit(run, c, need=_sm90_need, limit=_limit(H100_SHARED)))
            if fits[-1].ok:
                break
        offered.append(fits)

    monkeypatch.setattr(launch, "device_properties",
                        lambda index: {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": (9, 0)})
    monkeypatch.setattr(launch, "interpreted", lambda device: False)
    monkeypatch.setattr(launch, "launch_first_fitting", first_fitting)
    n, t = 2, 128
    q, k = (torch.empty(n, t, k_dim, dtype=torch.bfloat16, device="meta") for _ in range(2))
    v = torch.empty(n, t, k_dim, dtype=torch.bfloat16, device="meta")
    g, beta = torch.empty(n, t, k_dim, device="meta"), torch.empty(n, t, dtype=torch.bfloat16, device="meta")
    kda_chunk.forward(q, k, v, g, beta, scale=k_dim ** -0.5, output_final_state=True,
                      output_precision=output_precision)
    fits, = offered
    assert all(f.checked for f in fits)
    assert any(f.ok for f in fits), fits
