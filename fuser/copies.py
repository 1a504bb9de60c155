"""``torch.ops.fuser.saved_copy``: a copy that Inductor keeps.

The pass copies a tensor a fused op saves for its backward when the program writes that
tensor in place later (``o.mul_(gate)``, ``q.add_(1)``; see ``passes._protect_saved``). A plain
``clone`` does not survive compilation: Inductor removes clones of graph inputs as no-ops and
then performs the later write in the input's own buffer, so the backward would read the new
values. This custom op is opaque to those passes.

``saved_copy(x) -> Tensor``: a new tensor with ``x``'s values, shape and strides (contiguous for
a non-dense input, as ``torch.clone`` does); gradient passes through unchanged.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fuser::saved_copy", mutates_args=())
def saved_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@saved_copy.register_fake
def _saved_copy_fake(x):
    return x.clone()


def _backward(ctx, grad):
    return grad


saved_copy.register_autograd(_backward)
