"""Where the graph being compiled was cut out of the user's program.

fuser sees one captured graph at a time. A region the program computes across two graphs cannot
be fused, and ``explain()`` should say so only where a cut is real: Dynamo ended the graph at a
graph break (or began it where one resumed), or DDPOptimizer split the frame's graph at its
gradient-bucket boundaries. A graph whose output is simply what the function returns is no cut.

Read from Dynamo's state while it calls the backend: the instruction translator of the frame
being compiled (``InstructionTranslator.current_tx()``), its ``compile_subgraph_reason`` (a
``GraphCompileReason`` whose ``graph_break`` is set when a break ended the graph) and its code's
name (Dynamo names the code after a break ``torch_dynamo_resume_in_<fn>_at_<line>``); and, under
DDP, ``torch._dynamo.utils.get_optimize_ddp_mode()`` with the active DDP module. These are
torch internals (read on torch 2.13, tested in tests/patterns/test_review_cut_and_forced.py; the
same names exist in torch 2.11, not yet run there): anything missing reads as "no cut known", so
reports stay silent rather than guess.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Cuts:
    """Why the graph begins and ends where it does, when that is a cut of the program.

    Attributes:
        before: what cut the program just before the graph's first node (a sentence), or None.
        after: what cut it just after the graph's output, or None.
    """

    before: Optional[str] = None
    after: Optional[str] = None


def current() -> Cuts:
    """The cuts of the graph Dynamo is handing to the backend now (``Cuts()`` outside Dynamo or
    when its state cannot be read)."""
    before = after = None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not under Dynamo, or another torch
        tx = None
    if tx is not None:
        reason = getattr(getattr(tx, "output", None), "compile_subgraph_reason", None)
        if getattr(reason, "graph_break", False):
            text = str(getattr(reason, "reason", "") or "").strip().splitlines()
            after = "a graph break" + (f" ({text[0].strip()})" if text else "")
        name = getattr(getattr(tx, "f_code", None), "co_name", "") or ""
        if name.startswith("torch_dynamo_resume_in_"):
            where = name[len("torch_dynamo_resume_in_"):]
            before = f"a graph break (Dynamo resumed in {where.replace('_at_', ' at line ')})"
    if _ddp_pieces():
        bucket = "a gradient-bucket boundary of DDPOptimizer"
        before, after = before or bucket, after or bucket
    return Cuts(before, after)


def _ddp_pieces() -> bool:
    """Whether DDPOptimizer is splitting the frame's graph into pieces (each compiled alone)."""
    try:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        return (torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"
                and DistributedDataParallel._get_active_ddp_module() is not None)
    except Exception:  # noqa: BLE001 - no torch.distributed, or another torch
        return False
