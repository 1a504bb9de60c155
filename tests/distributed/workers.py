"""What each rank runs in tests/distributed (world size 2, gloo, CPU tensors, fuser's kernels in
Triton's interpreter). Every scenario compares the compiled distributed run with a
single-process eager run of the same model on the whole batch (loss and every parameter's
gradient) and records what fuser fused; rank 0 writes the results as JSON for the test.

Run by :func:`spawn` (``torch.multiprocessing.spawn``, a file store for the rendezvous).
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

OPTIONS = {"fuser.interpret": True}


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------

class Attention(nn.Module):
    """Causal self-attention written out (q/k/v/o projections, a registered causal buffer,
    an optional learned temperature on the scores)."""

    def __init__(self, dim: int = 32, heads: int = 4, max_seq: int = 16, temperature: bool = False,
                 causal: bool = True):
        super().__init__()
        self.hd, self.is_causal = dim // heads, causal
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.temperature = nn.Parameter(torch.ones(())) if temperature else None
        self.register_buffer("causal", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.hd).transpose(1, 2)  # -1: H, or H/tp heads under TP
        k = self.k(x).view(b, t, -1, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.hd).transpose(1, 2)
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
        if self.temperature is not None:
            s = s * self.temperature
        if self.is_causal:  # a plain-tensor mask: not with DTensor scores (no mixing in DTensor)
            s = s.masked_fill(~self.causal[:t, :t], float("-inf"))
        y = torch.softmax(s, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int = 32, temperature: bool = False, causal: bool = True, hidden: int = 64):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = Attention(dim, temperature=temperature, causal=causal)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, n_blocks: int = 2, dim: int = 32, temperature: bool = False, causal: bool = True,
                 hidden: int = 64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, temperature, causal, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean()


def _reference(model: nn.Module, x: torch.Tensor) -> tuple[float, dict]:
    """Eager loss and gradients of ``model`` (a copy is differentiated) on the whole batch."""
    import copy

    ref = copy.deepcopy(model)
    loss = ref(x)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_errors(model: nn.Module, ref_grads: dict, prefix: str = "") -> dict:
    out = {}
    for n, p in model.named_parameters():
        name = n.replace("_orig_mod.", "").replace("module.", "").replace("_checkpoint_wrapped_module.", "")
        g = _full(p.grad) if p.grad is not None else None
        out[prefix + name] = None if g is None else (g - ref_grads[name]).abs().max().item()
    return out


def _summary(rep) -> dict:
    return {
        "graphs": rep.graphs,
        "fused": [(m.pattern, m.graph_index) for m in rep.matches if m.fused],
        "rejected": [(r.pattern, r.reason) for r in rep.rejected],
        "shapes": [m.summary.get("shape") for m in rep.matches],
    }


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------

def _train_shard(step, model, x, ref_loss: float, ref_grads, rank: int, world: int) -> dict:
    """One training step of ``step`` (the wrapped, compiled model) on this rank's shard of the
    batch ``x``, compared with the single-process eager run (``ref_loss``, ``ref_grads`` of
    ``model``'s parameters): DDP and FSDP2 average the gradients over the ranks, and the mean of
    the per-rank losses is the whole batch's."""
    import fuser

    with fuser.report.collecting() as rep:
        loss = step(x.chunk(world)[rank])
    loss.backward()
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    return {"loss_error": abs(sum(t.item() for t in losses) / world - ref_loss),
            "grad_errors": _grad_errors(model, ref_grads), **_summary(rep)}


def ddp(rank: int, world: int) -> dict:
    """DDP with a tiny bucket cap: DDPOptimizer splits each graph at bucket boundaries and calls
    the backend once per piece. (A learned temperature, a parameter read in the middle of the
    attention core, was meant to make a cut fall inside it; DDP's 1 MiB minimum bucket puts the
    cuts between blocks, so no piece holds part of a core here.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    # DDPOptimizer needs bucket_cap_mb >= DDP's first bucket (1 MiB): an MLP of 2 x 32 x 4096
    # floats (1 MiB) per block makes the graph split into pieces all the same
    model = Net(n_blocks=3, temperature=True, hidden=4096)
    x = torch.randn(4, 16, 32)
    ref_loss, ref_grads = _reference(model, x)
    ddp_model = DDP(model, bucket_cap_mb=1)
    torch._dynamo.reset()
    compiled = torch.compile(ddp_model, backend="fuser", options=OPTIONS)
    return _train_shard(compiled, model, x, ref_loss, ref_grads, rank, world)


def fsdp2(rank: int, world: int) -> dict:
    """FSDP2 in torchtitan's order: compile each block (fullgraph), then ``fully_shard`` each
    block and the root."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Net(n_blocks=2)
    x = torch.randn(4, 16, 32)
    ref_loss, ref_grads = _reference(model, x)
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="fuser", fullgraph=True, options=OPTIONS)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train_shard(model, model, x, ref_loss, ref_grads, rank, world)


def tensor_parallel(rank: int, world: int) -> dict:
    """q/k/v column-parallel, o row-parallel; attention sees local tensors with H/tp heads
    (``use_local_output=True``) or head-sharded DTensors (``False``)."""
    import fuser
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for local in (True, False):
        torch.manual_seed(0)
        model = Net(n_blocks=1, causal=local)
        x = torch.randn(2, 16, 32)
        ref_loss, ref_grads = _reference(model, x)
        for block in model.blocks:
            plan = {f"attn.{n}": ColwiseParallel(use_local_output=local) for n in "qkv"}
            plan["attn.o"] = RowwiseParallel()
            parallelize_module(block, mesh, plan)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="fuser", options=OPTIONS)
        with fuser.report.collecting() as rep:
            loss = compiled(x)  # every rank the same batch
        loss.backward()
        out[f"local={local}"] = {"loss_error": abs(_full(loss).item() - ref_loss),
                                 "grad_errors": _grad_errors(model, ref_grads), **_summary(rep)}
    return out


def _sequence_sharded_attention(q, k, v, mesh):
    """Attention over q, k, v ``[B, H, N/cp, D]`` (each rank its block of the sequence) made
    DTensors sharded on the sequence dim, as context parallelism has them."""
    from torch.distributed.tensor import DTensor, Shard

    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    p = torch.softmax((q @ k.transpose(-2, -1)) * 0.25, dim=-1)
    return (p @ v).full_tensor()


def context_parallel(rank: int, world: int) -> dict:
    """Sequence-sharded DTensor q, k, v: fuser must leave the region as written (DTensor gathers
    what it needs, exactly as eager) and say why."""
    import fuser
    from fuser import distributed
    from fuser import registry
    from fuser.graph import GraphView
    from fuser.options import resolve
    from fuser.pattern import MatchContext
    from fuser.static import StaticEvaluator
    from fuser import testing
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    ref = torch.softmax((q @ k.transpose(-2, -1)) * 0.25, dim=-1) @ v
    mine = [t.chunk(world, dim=2)[rank] for t in (q, k, v)]
    fn = functools.partial(_sequence_sharded_attention, mesh=mesh)

    # the check itself, on Dynamo's graph of the function (fake DTensors sharded on the sequence)
    (gm, example), = testing.capture(fn, *mine)
    opts, _ = resolve(OPTIONS, None)
    view = GraphView(gm.graph, grad_enabled=False)
    ctx = MatchContext(view=view, evaluator=StaticEvaluator(view, {}, owner=gm), options=opts, grad_enabled=False)
    pattern = registry.load("attention")
    reasons = []
    for anchor in pattern.anchors(view):
        m = pattern.match(anchor, ctx)
        if m is not None and hasattr(m, "region"):
            reasons.append(distributed.sharding_decline(m, view))

    # end to end: compiled, the result must be eager's; explain must say it was declined
    torch._dynamo.reset()
    with fuser.report.collecting() as rep:
        got = torch.compile(fn, backend="fuser", options=OPTIONS)(*mine)
    return {"direct_reasons": reasons, "error": (got - ref).abs().max().item(), **_summary(rep)}


def context_parallel_sdpa(rank: int, world: int) -> dict:
    """torch's own ``context_parallel`` (ring attention through SDPA) in eager, on the CPU:
    whether it runs here at all (it hooks only the flash/efficient/cuDNN SDPA kernels)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as cp

    mesh = init_device_mesh("cpu", (world,))
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    try:
        with cp(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return {"runs": True}
    except Exception as exc:  # noqa: BLE001 - what happens is the result
        return {"runs": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


SCENARIOS = {f.__name__: f for f in (ddp, fsdp2, tensor_parallel, context_parallel, context_parallel_sdpa)}


# --------------------------------------------------------------------------------------------
# Spawning
# --------------------------------------------------------------------------------------------

def _main(rank: int, world: int, store: str, scenario: str, out: str) -> None:
    os.environ.setdefault("FUSER_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = SCENARIOS[scenario](rank, world)
    except BaseException:
        result = {"exception": traceback.format_exc()}
    try:
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:  # whole or not at all (spawn reads its existence as "every rank finished")
            with open(out + ".tmp", "w") as f:
                json.dump(gathered, f, default=str)
            os.replace(out + ".tmp", out)
    finally:
        dist.destroy_process_group()


def spawn(scenario: str, world: int = 2) -> list:
    """Run ``scenario`` on ``world`` spawned ranks; returns each rank's result (a dict)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        try:
            mp.spawn(_main, args=(world, os.path.join(d, "store"), scenario, out), nprocs=world, join=True)
        except mp.ProcessExitedException as exc:
            # rank 0 writes the file after the all-gather: every rank finished its scenario and
            # sent its result, so a rank killed by a signal after that died tearing the process
            # group down (seen once in CI on a loaded 2-core machine: gloo's "terminate called
            # without an active exception", SIGABRT), not in what is tested
            if not os.path.exists(out):
                raise
            warnings.warn(f"scenario {scenario!r}: every rank sent its result, then {exc}")
        with open(out) as f:
            results = json.load(f)
    for r in results:
        if "exception" in r:
            raise AssertionError("a rank failed:\n" + r["exception"])
    return results


if __name__ == "__main__":  # python tests/distributed/workers.py SCENARIO: print the results
    import sys

    print(json.dumps(spawn(sys.argv[1]), indent=1, default=str))
