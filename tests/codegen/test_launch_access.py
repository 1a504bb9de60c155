"""Inductor's analysis of which arguments fuser's kernels read and write, memoised
(``launch._memoize_access_analysis``): torch lowers a user-defined kernel to TTIR on the main
thread for every traced launch, several times per launch; for fuser's kernels the answer is kept
per (kernel, argument dtypes and scalar values).

On the CPU: the analysis for an sm90 target (the H100 stand-in of ``test_inline_ops``), compared
with torch's own; the trace of a fused op, which must be the same graph with and without the memo.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import triton
import triton.language as tl
from torch._higher_order_ops import triton_kernel_wrap as tkw
from torch._subclasses.fake_tensor import FakeTensorMode

import fuser  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.codegen import launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patterns"))
from test_inline_ops import GPU, _an_h100, _qkv, _trace  # noqa: E402,F401


@triton.jit
def _scale(X, Y, N, alpha, BLOCK: tl.constexpr):
    """Y[:N] = alpha · X[:N] (reads X, writes Y)."""
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < N) * alpha, mask=i < N)


@triton.jit
def _not_ours(X, Y, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i))


@triton.jit
def _impure_asm(X, Y, BLOCK: tl.constexpr):
    """Y = X through inline assembly not marked pure: torch's analysis cannot tell what it writes."""
    i = tl.arange(0, BLOCK)
    y = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tl.load(X + i)], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(Y + i, y)


@pytest.fixture
def memo(monkeypatch):
    """A fresh memo and counters; the wrapped analysis (the name this torch has)."""
    monkeypatch.setattr(launch, "_access_memo", {})
    monkeypatch.setattr(launch, "_access_stats", dict(launch._access_stats, calls=0, memo=0, run_s=0.0, failed=[]))
    monkeypatch.setattr(launch, "_analysis_warned", __import__("weakref").WeakSet())
    launch._memoize_access_analysis()
    names = [n for n in launch.ACCESS_ANALYSES if getattr(getattr(tkw, n, None), "_fuser_memo", False)]
    assert names, "torch's access analysis was not wrapped (its name or parameters changed?)"
    return getattr(tkw, names[0])


def _names(answer):
    """The argument names an answer says are written (both forms torch has returned)."""
    if isinstance(answer, list):
        return sorted(answer)
    return sorted(dep.name for dep in answer.read_writes.writes)


def _args(mode, n=8, dtype=torch.float32, alpha=2.0, block=16, size=8):
    with mode:
        x, y = torch.empty(size, dtype=dtype, device=GPU), torch.empty(size, dtype=dtype, device=GPU)
    return {"X": x, "Y": y, "N": n, "alpha": alpha, "BLOCK": block}


def test_the_memo_answers_what_torchs_analysis_answers(memo):
    launch._TracedLaunch(_scale)  # what registers a kernel as fuser's
    mode = FakeTensorMode()
    first = memo(_scale, _args(mode), {})
    assert _names(first) == ["Y"] and _names(memo.__wrapped__(_scale, _args(mode), {})) == ["Y"]
    assert launch.access_analysis_stats()["calls"] == 1 and launch.access_analysis_stats()["memo"] == 0
    # other tensors of the same dtypes (other sizes): the memo's answer, a copy of its own
    again = memo(_scale, _args(mode, size=40), {})
    assert _names(again) == ["Y"] and again is not first
    stats = launch.access_analysis_stats()
    assert (stats["calls"], stats["memo"]) == (2, 1) and stats["run_s"] > 0
    # another dtype, another scalar value (Triton specialises integers by value) or constexpr:
    # torch's analysis runs again
    memo(_scale, _args(mode, dtype=torch.float16), {})
    memo(_scale, _args(mode, n=1), {})
    memo(_scale, _args(mode, alpha=3.0), {})
    memo(_scale, _args(mode, block=32), {})
    assert launch.access_analysis_stats()["memo"] == 1 and len(launch._access_memo) == 5


def test_other_kernels_and_unknown_arguments_go_to_torch(memo):
    mode = FakeTensorMode()
    with mode:
        x, y = torch.empty(16, device=GPU), torch.empty(16, device=GPU)
    assert _names(memo(_not_ours, {"X": x, "Y": y, "BLOCK": 16}, {})) == ["Y"]
    launch._TracedLaunch(_scale)
    args = dict(_args(mode), alpha=object())  # a value the key cannot name
    assert launch._access_key(_scale, args, {}) is None
    assert launch._access_key(_scale, _args(mode), {"X": ("stable", [16])}) is None  # host TMA descriptors
    assert launch.access_analysis_stats()["calls"] == 0


def _kernel_launches(gm):
    return [(str(n.kwargs["kernel_idx"]), sorted(n.kwargs["tensors_to_clone"])) for n in gm.graph.nodes
            if "triton_kernel_wrapper_functional" in str(n.target)]


def test_a_traced_fused_op_is_the_same_graph_with_the_memo(memo, monkeypatch):
    """The attention backward traced as AOTAutograd does (functionalisation asks torch's analysis
    about each launch): with the memo, each distinct launch is analysed once, and the graph
    (its launches and the arguments each one writes) is what torch's analysis alone gives."""
    q, k, v = _qkv()
    lse = torch.empty(2, 4, 40)
    out = torch.empty(2, 40, 4, 16, dtype=q.dtype).transpose(1, 2)
    inf = float("-inf")
    args = (torch.empty_like(out), q, k, v, out, lse, None, 0.25, "none", "none", "backward=two_kernel;autotune=0",
            [True, True, True], inf, inf, "replace", "", [], inf, "replace")
    op = torch.ops.fuser.attention_backward.default
    gm, _, _ = _trace(op, args)
    gm2, _, _ = _trace(op, args)
    stats = launch.access_analysis_stats()
    launches = _kernel_launches(gm)
    assert launches and stats["calls"] >= 2 * len(launches) and stats["memo"] >= len(launches), stats
    assert [w for _, w in _kernel_launches(gm2)] == [w for _, w in launches]
    monkeypatch.setattr(launch, "_access_key", lambda *a: None)  # torch's analysis every time
    calls = launch.access_analysis_stats()["calls"]
    gm3, _, _ = _trace(op, args)
    assert launch.access_analysis_stats()["calls"] == calls
    assert [w for _, w in _kernel_launches(gm3)] == [w for _, w in launches]


def test_a_kernel_torch_cannot_analyse_is_reported(memo):
    """Where torch's analysis fails (it catches the error and answers that every tensor argument
    is written: Inductor then copies the fused op's inputs each call and skips CUDA graphs), the
    memo warns once for that kernel, naming it, and lists it; the answer is torch's."""
    launch._TracedLaunch(_impure_asm)
    mode = FakeTensorMode()
    with mode:
        x, y = torch.empty(16, dtype=torch.int32, device=GPU), torch.empty(16, dtype=torch.int32, device=GPU)
    with pytest.warns(RuntimeWarning, match="kernel _impure_asm writes failed.*copy the fused op's inputs"):
        answer = memo(_impure_asm, {"X": x, "Y": y, "BLOCK": 16}, {})
    assert _names(answer) == ["X", "Y"]
    assert launch.access_analysis_stats()["failed"] == ["_impure_asm"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mode:
            y2 = torch.empty(32, dtype=torch.int32, device=GPU)
        launch._access_memo.clear()  # torch's analysis runs again: no second warning
        memo(_impure_asm, {"X": x, "Y": y2, "BLOCK": 16}, {})
    assert launch.access_analysis_stats()["failed"] == ["_impure_asm"]


def test_the_failure_log_handler_never_raises_into_torchs_fallback():
    """torch logs its analysis failure from inside its own ``except``: an exception without a
    message (a bare ``assert``) or a record without one must not make the handler raise there."""
    import logging

    logger = logging.getLogger("fuser.test_analysis_failures")
    with launch._AnalysisFailures(logger) as failures:
        try:
            raise AssertionError()
        except AssertionError:
            logger.warning("Encountered an exception in identify_accessed_tensors, assuming every input is mutated",
                           exc_info=True)
        logger.warning("Encountered an exception in identify_mutated_tensors, assuming every input is mutated")
        logger.warning("something else")
    assert failures.messages == ["AssertionError: ", "Encountered an exception in identify_mutated_tensors, "
                                 "assuming every input is mutated"]
    assert failures not in logger.handlers
