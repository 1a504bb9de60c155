"""What every pattern's planner asks of the device a match runs on."""

from __future__ import annotations

import torch

from fuser import costmodel as cm
from fuser.codegen import launch
from fuser.pattern import MatchContext


def device_model(dev: torch.device, ctx: MatchContext) -> cm.DeviceModel:
    """The cost model's :class:`fuser.costmodel.DeviceModel` for a match on ``dev``: the GPU's
    table by its name and SM count (:func:`fuser.costmodel.device_model`; the interpreter, on a
    CPU device, is modelled as an H100), with launches at no host time where the
    compiled graph is replayed from CUDA graphs (``ctx.options.cuda_graphs``)."""
    return cm.device_model(launch.gpu_name(dev), launch.sm_count(dev), cuda_graphs=ctx.options.cuda_graphs)
