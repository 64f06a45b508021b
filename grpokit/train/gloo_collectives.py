"""FSDP2's all-gather and reduce-scatter on gloo (CPU) replaced by faster equivalents.

On one machine gloo's allgather and reduce_scatter move the same bytes 2-3x slower (wall and CPU) than broadcasts
and an all-reduce (benchmarks/gloo_collectives.py). FSDP2 lets a unit take custom collectives through
`set_custom_all_gather` / `set_custom_reduce_scatter`, whose base classes live in a private torch module: this
module is imported only for a sharded run on gloo, so that no other run depends on that private API, and where a
torch lacks it the units keep FSDP2's own collectives (same values, slower).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("grpokit")

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # another torch's layout: FSDP2's own collectives
    AllGather = ReduceScatter = None


def use_faster_gloo_collectives(units) -> bool:
    """Give each FSDP unit the broadcast all-gather and the all-reduce reduce-scatter; False where this torch has
    no custom-collective API (the units are left as they are)."""
    if AllGather is None or not all(hasattr(u, "set_custom_all_gather") for u in units):
        logger.debug("FSDP2 on gloo: this torch has no custom collectives; using FSDP2's own")
        return False
    for unit in units:
        unit.set_custom_all_gather(_BroadcastAllGather())
        unit.set_custom_reduce_scatter(_AllReduceScatter())
    return True


class _BroadcastAllGather(AllGather or object):
    """FSDP2's all-gather on gloo as one broadcast of each process's shard: gloo's allgather moves the same bytes
    2-3x slower (wall and CPU) on one machine. Synchronous (None: no work handle), as gloo's collectives are
    waited on at once here anyway."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        rank, world = group.rank(), group.size()
        chunks = output_tensor.chunk(world)
        if chunks[rank].data_ptr() != input_tensor.data_ptr():  # FSDP copies its input into its own slot already
            chunks[rank].copy_(input_tensor)
        works = [torch.distributed.broadcast(chunk, torch.distributed.get_global_rank(group, source), group=group,
                                             async_op=True) for source, chunk in enumerate(chunks)]
        for work in works:
            work.wait()
        return None


class _AllReduceScatter(ReduceScatter or object):
    """FSDP2's reduce-scatter on gloo as an all-reduce of its (temporary, flat) input and a copy of this process's
    part: gloo's reduce_scatter is 2-3x slower for the same tensor on one machine."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        torch.distributed.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
        return None
