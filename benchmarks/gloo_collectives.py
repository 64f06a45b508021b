"""gloo's collectives at FSDP2's sizes on this machine: wall and CPU seconds of all-gather and reduce-scatter, each
against the form grpokit/train/fsdp.py uses on gloo (one broadcast per process; an all-reduce and a copy).

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py

Sizes: 16 MiB (one decoder layer of the hidden-512 benchmark model, fp32) and 297 MiB (its 151,936 x 512 embedding).
"""

import time

import torch
import torch.distributed as dist


def timed(fn, repeats=3):
    """(wall, CPU) seconds per call, after one warm-up; CPU is this process's, every thread's."""
    dist.barrier()
    fn()
    dist.barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    return (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def gather_by_broadcasts(out, shard):
        chunks = out.chunk(world)
        chunks[rank].copy_(shard)
        for work in [dist.broadcast(chunk, source, async_op=True) for source, chunk in enumerate(chunks)]:
            work.wait()

    def scatter_by_all_reduce(out, full):
        dist.all_reduce(full)
        out.copy_(full.chunk(world)[rank])

    for mib in (16, 297):
        numel = mib * 2**20 // 4
        full, shard, out = torch.randn(numel), torch.randn(numel // world), torch.empty(numel)
        rows = {"all_gather_into_tensor": timed(lambda: dist.all_gather_into_tensor(out, shard)),
                "all-gather as broadcasts": timed(lambda: gather_by_broadcasts(out, shard)),
                "reduce_scatter_tensor": timed(lambda: dist.reduce_scatter_tensor(shard, full)),
                "reduce-scatter as all_reduce": timed(lambda: scatter_by_all_reduce(shard, full)),
                "all_reduce": timed(lambda: dist.all_reduce(full))}
        if rank == 0:
            for name, (wall, cpu) in rows.items():
                print(f"{mib} MiB {name}: {wall:.3f} s wall, {cpu:.3f} s CPU", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
