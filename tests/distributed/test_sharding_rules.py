"""DTensor sharding rules of fuser's ops (fuser/distributed.py), in one process.

A fake process group of world size 2 (``torch.testing._internal.distributed.fake_pg``: every
collective a no-op, this process rank 0) is enough to check what DTensor does with each op:
which placements it accepts without communication (replicated, batch-sharded, head-sharded),
what placements the outputs get, and that the local outputs are the op's own on the local
shards — forward, and backward through each op's autograd formula (the backward op). The
values of the ops themselves are checked against float64 references in tests/codegen and
tests/patterns; tests/distributed/test_training_stacks.py runs real ranks.

The tensors live on :data:`DEVICE`: the CPU (Triton's interpreter) where no GPU is present, the
GPU otherwise — so that the rules are exercised on the GPU machine's torch as well (its Triton's
interpreter cannot run these kernels: ``pytest -m gpu`` selects the GPU copies).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed.tensor")

from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import fuser  # noqa: E402,F401  (registers the ops and their rules)
from fuser import distributed  # noqa: E402
from fuser.patterns import h2o_ops  # noqa: E402

NEG_INF = float("-inf")
#: where the tests' tensors are made (module docstring)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: on a GPU machine every test here is a GPU test
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


@pytest.fixture(autouse=True)
def _on_device():
    with torch.device(DEVICE):
        yield


MESH_DEVICE = DEVICE  # the mesh fixture's device (conftest.py)


def _local(t: torch.Tensor, p) -> torch.Tensor:
    """Rank 0's piece of ``t`` under placement ``p``."""
    return t.chunk(2, dim=p.dim)[0].contiguous() if isinstance(p, Shard) else t


def _dt(t, p, mesh, grad=False):
    x = DTensor.from_local(_local(t, p), mesh, [p], run_check=False)
    return x.requires_grad_() if grad else x


def _check(outs_dt, outs_local, placements):
    for o, want, p in zip(outs_dt, outs_local, placements):
        assert o.placements == (p,), (o.placements, p)
        torch.testing.assert_close(o.to_local(), want, rtol=0, atol=0)


ATTN_ARGS = dict(scale=0.25, causal="top_left", mask_kind="none", plan="backward=two_kernel", mask_fill=NEG_INF,
                 causal_fill=NEG_INF, causal_fill_mode="replace", pred="", pred_consts=[], pred_fill=NEG_INF,
                 pred_fill_mode="replace")


def _attention(q, k, v, mask=None, mask_kind="none", need_lse=True):
    a = dict(ATTN_ARGS, mask_kind=mask_kind)
    return torch.ops.fuser.attention(q, k, v, mask, a["scale"], a["causal"], a["mask_kind"], need_lse, a["plan"],
                                     a["mask_fill"], a["causal_fill"], a["causal_fill_mode"], a["pred"],
                                     a["pred_consts"], a["pred_fill"], a["pred_fill_mode"])


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1)], ids=["replicated", "batch", "heads"])
def test_attention_forward_and_backward(mesh, placement):
    torch.manual_seed(0)
    # GQA (4 query heads, 2 kv heads) and a key-padding mask [B, 1, 1, N] that broadcasts the heads
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    mask = torch.rand(2, 1, 1, 8) > 0.2
    mask[..., 0] = True
    dq, dk, dv = (_dt(t, placement, mesh, grad=True) for t in (q, k, v))
    dmask = _dt(mask, placement if placement != Shard(1) else Replicate(), mesh)
    out, lse = _attention(dq, dk, dv, dmask, "bool_keep")
    (out * out).sum().backward()
    lq, lk, lv = (_local(t, placement).clone().requires_grad_() for t in (q, k, v))
    lout, llse = _attention(lq, lk, lv, _local(mask, placement if placement != Shard(1) else Replicate()), "bool_keep")
    (lout * lout).sum().backward()
    _check((out, lse), (lout, llse), (placement, placement))
    _check((dq.grad, dk.grad, dv.grad), (lq.grad, lk.grad, lv.grad), (placement,) * 3)


def test_no_communication_for_batch_and_head_shards(mesh):
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    for p in (Shard(0), Shard(1)):
        with CommDebugMode() as comm:
            out, lse = _attention(*(_dt(t, p, mesh) for t in (q, k, v)))
        assert comm.get_total_counts() == 0 and out.placements == (p,)


def test_sequence_sharded_inputs_are_gathered(mesh):
    """What the decline of context-parallel regions avoids: the rule has no sequence strategy,
    so DTensor gathers the shards before the op runs."""
    q = torch.randn(1, 2, 8, 16)
    with CommDebugMode() as comm:
        out, _ = _attention(*(_dt(q, Shard(2), mesh) for _ in range(3)))
    assert comm.get_total_counts() > 0
    assert Shard(2) not in out.placements


def _strategies(op, layout_fn, **named):
    """The strategies the rule of ``op`` lists for arguments given by name (tensors as shapes)."""
    from types import SimpleNamespace

    mesh = SimpleNamespace(size=lambda: 2)
    spec = lambda shape: SimpleNamespace(shape=shape, mesh=mesh, placements=(Replicate(),))  # noqa: E731
    names = [x.name for x in op._schema.arguments]
    args = [spec(v) if isinstance(v, tuple) else v for v in (named.get(n) for n in names)]
    full = dict(zip(names, args))
    return distributed.strategies(op, layout_fn(**full), args, len(op._schema.returns))


@pytest.mark.parametrize("heads, split", [((4, 2), True), ((6, 3), False), ((4, 1), True)],
                         ids=["gqa-even", "gqa-uneven", "mqa"])
def test_gqa_heads_split_only_in_pairs(heads, split):
    """6 query heads and 3 kv heads on 2 ranks: rank 0 would get query heads 0-2 (which read kv
    heads 0, 1) and kv heads 0-1 — not the pairs GQA needs: no head strategy is offered (DTensor
    then redistributes). 4 and 2 split into pairs; one kv head (MQA) is replicated."""
    from fuser.patterns import attention_ops

    hq, hkv = heads
    got = _strategies(torch.ops.fuser.attention.default, attention_ops._sharding_fwd, q=(2, hq, 8, 16),
                      k=(2, hkv, 8, 16), v=(2, hkv, 8, 16), mask=None, need_lse=True, **ATTN_ARGS)
    head = [ins for outs, ins in got if outs[0] == Shard(1)]
    assert bool(head) == split
    if split:
        assert head[0][:3] == [Shard(1), Shard(1) if hkv > 1 else Replicate(), Shard(1) if hkv > 1 else Replicate()]
    assert any(outs[0] == Shard(0) for outs, _ in got)  # batch always


def test_cache_key_sees_non_tensor_arguments(mesh):
    """need_lse changes whether lse is an empty placeholder (replicated) or sharded: the same
    tensors with need_lse=False after True must not reuse the cached strategy."""
    q = torch.randn(2, 2, 8, 16)
    args = [_dt(q, Shard(0), mesh) for _ in range(3)]
    _, lse = _attention(*args, need_lse=True)
    assert lse.placements == (Shard(0),)
    _, lse = _attention(*args, need_lse=False)
    assert lse.placements == (Replicate(),) and lse.to_local().numel() == 0


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=["batch", "heads"])
def test_attention_kl_forward_and_backward(mesh, placement):
    torch.manual_seed(2)
    ts = [torch.randn(2, 2, 8, 16) for _ in range(4)]
    dts = [_dt(t, placement, mesh, grad=True) for t in ts]
    lts = [_local(t, placement).clone().requires_grad_() for t in ts]
    call = lambda a: torch.ops.fuser.attention_kl(*a, None, 0.25, 0.25, "top_left", "none", True,  # noqa: E731
                                                  "split_k=1;backward=two_kernel", NEG_INF, NEG_INF, NEG_INF, NEG_INF,
                                                  "replace", False)
    outs, louts = call(dts), call(lts)
    outs[0].sum().backward()
    louts[0].sum().backward()
    _check(outs, louts, (placement,) * 4)
    _check([t.grad for t in dts], [t.grad for t in lts], (placement,) * 4)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=["batch", "heads"])
def test_h2o(mesh, placement):
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16)
    call = lambda q, k, v: torch.ops.fuser.h2o(q, k, v, None, 0.25, "top_left", "none", True,  # noqa: E731
                                               h2o_ops.plan_string(), NEG_INF, "replace", NEG_INF)
    outs = call(*(_dt(t, placement, mesh) for t in (q, k, v)))
    _check(outs, call(*(_local(t, placement) for t in (q, k, v))), (placement, placement))


@pytest.mark.parametrize("dim", [0, 2], ids=["batch", "heads"])
def test_kda_forward_and_backward(mesh, dim):
    """KDA in the [B, T, H, K] layout: the lead dims (B and H) are independent recurrences."""
    torch.manual_seed(4)
    b, t, h, kd, vd = 2, 8, 2, 8, 8
    q, k = torch.randn(b, t, h, kd) * 0.3, torch.nn.functional.normalize(torch.randn(b, t, h, kd), dim=-1)
    v, g = torch.randn(b, t, h, vd), -torch.rand(b, t, h, kd) * 0.1
    beta, h0 = torch.rand(b, t, h), torch.randn(b, h, kd, vd) * 0.1
    p, ph0 = Shard(dim), Shard(0 if dim == 0 else 1)

    def call(q, k, v, g, beta, h0):
        return torch.ops.fuser.kda(q, k, v, g, beta, h0, [1, 1, 1, 1, 1], 0, t, kd ** -0.5, False, 1, torch.float32,
                                   True, torch.float32, "plan=recurrent")

    ins = (q, k, v, g, beta, h0)
    pls = (p, p, p, p, Shard(0) if dim == 0 else Shard(2), ph0)
    dts = [_dt(x, pl, mesh, grad=True) for x, pl in zip(ins, pls)]
    lts = [_local(x, pl).clone().requires_grad_() for x, pl in zip(ins, pls)]
    outs, louts = call(*dts), call(*lts)
    (outs[0].sum() + outs[1].sum()).backward()
    (louts[0].sum() + louts[1].sum()).backward()
    _check(outs, louts, (p, ph0))
    _check([x.grad for x in dts], [x.grad for x in lts], pls)


@pytest.mark.parametrize("dim", [0, 2], ids=["batch", "heads"])
@pytest.mark.parametrize("k_dim", [8, 72], ids=["states_recomputed", "states_kept"])
def test_kda_save_forward_and_backward(mesh, dim, k_dim):
    """``kda.save=workspaces``: fuser::kda_save returns the forward's workspaces beside o and the
    state, and its autograd formula hands them to fuser::kda_backward_saved. Every workspace is
    ``[*L, ...]``, so a batch- or head-sharded call runs on the local shards without communication
    and the workspaces come out sharded like the inputs; the backward reads them as DTensors. At
    K=72 with float32 dots the chunk states are among them (``kda_ops.keeps_states``), at K=8 their
    slot is an empty placeholder (no placement to check)."""
    from fuser.patterns import kda_ops

    torch.manual_seed(5)
    b, t, h, vd = 2, 10, 2, 8
    q, k = torch.randn(b, t, h, k_dim) * 0.3, torch.nn.functional.normalize(torch.randn(b, t, h, k_dim), dim=-1)
    v, g = torch.randn(b, t, h, vd), -torch.rand(b, t, h, k_dim) * 0.1
    beta, h0 = torch.rand(b, t, h), torch.randn(b, h, k_dim, vd) * 0.1
    p, ph0 = Shard(dim), Shard(0 if dim == 0 else 1)
    plan = kda_ops.plan_string("chunk", chunk=16, save="workspaces")
    assert kda_ops.keeps_states(k_dim, "float32") == (k_dim > 64)

    def call(q, k, v, g, beta, h0):
        return torch.ops.fuser.kda_save(q, k, v, g, beta, h0, [1, 1, 1, 1, 1], 0, t, k_dim ** -0.5, False, 1,
                                        torch.float32, True, torch.float32, plan)

    ins = (q, k, v, g, beta, h0)
    pls = (p, p, p, p, Shard(0) if dim == 0 else Shard(2), ph0)
    dts = [_dt(x, pl, mesh, grad=True) for x, pl in zip(ins, pls)]
    lts = [_local(x, pl).clone().requires_grad_() for x, pl in zip(ins, pls)]
    with CommDebugMode() as comm:
        outs = call(*dts)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    louts = call(*lts)
    assert len(outs) == 2 + len(kda_ops.SAVED)
    # o and the final state as kda's; each workspace [*L, ...] sharded on the same lead dim
    # ([B, H, ...]: the batch dim 0, the heads dim 1), the empty states slot replicated
    lead = Shard(0) if dim == 0 else Shard(1)
    kept = [(o, lo) for o, lo in zip(outs[2:], louts[2:]) if lo.numel()]
    assert len(kept) == len(kda_ops.SAVED) - (0 if k_dim > 64 else 1)
    _check(outs[:2] + tuple(o for o, _ in kept), louts[:2] + tuple(lo for _, lo in kept),
           (p, ph0) + (lead,) * len(kept))
    (outs[0].sum() + outs[1].sum()).backward()
    (louts[0].sum() + louts[1].sum()).backward()
    _check([x.grad for x in dts], [x.grad for x in lts], pls)


def test_saved_copy(mesh):
    x = _dt(torch.randn(4, 6), Shard(1), mesh)
    y = torch.ops.fuser.saved_copy(x)
    assert y.placements == (Shard(1),)
    torch.testing.assert_close(y.to_local(), x.to_local(), rtol=0, atol=0)


def test_every_fused_op_has_a_rule():
    """Each op of the ``fuser`` namespace (what the patterns emit, their backwards and the pass's
    helpers), read off ``torch.library`` so that a new op is covered, declares its layout."""
    from torch._library.custom_ops import OPDEFS

    names = sorted(name.split("::", 1)[1] for name in OPDEFS if name.startswith("fuser::"))
    assert {"attention", "attention_backward", "attention_kl", "attention_kl_backward", "h2o", "kda",
            "kda_backward", "kda_save", "kda_backward_saved", "saved_copy"} <= set(names), names
    ops = {str(op) for op in distributed.LAYOUTS}
    assert [name for name in names if f"fuser.{name}.default" not in ops] == []
