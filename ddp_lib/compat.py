"""Collective names that moved between torch releases, resolved once for the whole package.

torch 2.13 names the flat-tensor collectives `all_gather_single` / `reduce_scatter_single` and deprecates
`all_gather_into_tensor` / `reduce_scatter_tensor`; the releases the package still supports (torch>=2.4)
only have the older names. Package code calls these two aliases, never `dist.<new name>` directly.
"""

from __future__ import annotations

import torch.distributed as dist

#: `all_gather_single(output, input, group=None, async_op=False)`: every rank's `input` into one flat `output`
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: `reduce_scatter_single(output, input, op=SUM, group=None, async_op=False)`: rank r gets the reduced slice r
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
