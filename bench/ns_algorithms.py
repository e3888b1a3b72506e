"""Every distribution of one matrix's Newton-Schulz side by side on the GPUs of this run: for
each case and requested algorithm, the plan it ran, the median time (CUDA events), the cost
model's estimate and the error against a float64 run of the same schedule; then, for the
cases named by --profile, the kernels of one call on rank 0 (torch.profiler), one per line,
with totals per kernel.

    torchrun --nproc_per_node=2 bench/ns_algorithms.py --cases 4096x4096:1,3001x10007:0 \\
        [--algorithms auto,duplicated,gram_allreduce,gram_newton_schulz] \\
        [--profile 4096x4096:1:auto]

A case is ROWSxCOLS:DIM, the matrix sharded evenly along DIM (0 or 1) over the group; bf16,
quintic 5 unless --dtype / --schedule say otherwise. This is the tool behind the per-algorithm
tables and kernel timelines of docs/BENCHMARKS.md; bench_newton_schulz.py is the benchmark
with the baselines.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
import warnings

import torch
import torch.distributed as dist

# The benchmark's helpers (it also puts python/ on the path for shardmuon).
from bench_newton_schulz import (DTYPES, Timer, even_split, gather_shards, relative_error,
                                 torch_newton_schulz)
from shardmuon.torch import NewtonSchulz


# PyTorch (2.11 on the lent machines) warns that its profiler "clears events at the end of each
# cycle" even where no schedule makes cycles, as here (a bug, fixed upstream in
# pytorch/pytorch#180387): a line of noise in every profile.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)


def parse_case(text):
    fields = text.split(":")
    rows, cols = (int(x) for x in fields[0].split("x"))
    return rows, cols, int(fields[1]), fields[2:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="4096x4096:1,4096x4096:0,8192x8192:1,3001x10007:0,3001x10007:1")
    parser.add_argument("--algorithms", default="auto,duplicated,gram_allreduce,gram_newton_schulz")
    parser.add_argument("--profile", default="", help="ROWSxCOLS:DIM:ALGORITHM,... to trace")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--schedule", default="quintic:5")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmups", type=int, default=3)
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # Ranks may share a GPU (scripts/rank_host_id.sh), to check the script on one GPU.
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    dtype = DTYPES[args.dtype]
    schedule, steps = args.schedule.split(":")
    timer = Timer(args.warmups, args.repeats, world)

    def report(text):
        if rank == 0:
            print(text, flush=True)

    def shard_of(rows, cols, dim):
        sizes = even_split((rows, cols)[dim], world)
        generator = torch.Generator(device="cuda").manual_seed(rows + cols)
        matrix = torch.randn(rows, cols, device="cuda", generator=generator).to(dtype)
        shard = matrix.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()
        return matrix, shard, sizes

    report(f"# {torch.cuda.get_device_name()} x {world}, {args.dtype}, {schedule} {steps}")
    report("| shape | shards | requested | ran | time (ms) | model (ms) | error |")
    report("|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        rows, cols, dim, _ = parse_case(case)
        matrix, shard, sizes = shard_of(rows, cols, dim)
        work = torch.empty_like(shard)
        reference = None
        for algorithm in args.algorithms.split(","):
            ns = NewtonSchulz(dist.group.WORLD, ns_steps=int(steps), coefficient_type=schedule,
                              algorithm=algorithm)
            shape = (rows, cols)
            ran = ns.plan(shape, dim, sizes) + (" + (e)" if ns.uses_gram_iteration(shape, dim, sizes) else "")
            model = ns.estimate_seconds(shape, dim, sizes) * 1e3
            ms = timer.median_ms(lambda: work.copy_(shard), lambda: ns(work, shape, dim, sizes))
            work.copy_(shard)
            ns(work, shape, dim, sizes)
            if reference is None:
                reference = torch_newton_schulz(matrix.double(), ns.coefficients(), torch.float64)
            error = relative_error(gather_shards(work, dim, sizes, world), reference)
            report(f"| {rows}x{cols} | dim {dim} | {algorithm} | {ran} | {ms:.3f} | {model:.3f} | {error:.3e} |")

    for case in filter(None, args.profile.split(",")):
        rows, cols, dim, (algorithm,) = parse_case(case)
        _, shard, sizes = shard_of(rows, cols, dim)
        work = torch.empty_like(shard)
        shape = (rows, cols)
        ns = NewtonSchulz(dist.group.WORLD, ns_steps=int(steps), coefficient_type=schedule, algorithm=algorithm)
        for _ in range(args.warmups):
            work.copy_(shard)
            ns(work, shape, dim, sizes)
        # Host time of the call (until it returns) against its events.
        per_call = []
        for _ in range(10):
            work.copy_(shard)
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record()
            ns(work, shape, dim, sizes)
            host = (time.perf_counter() - began) * 1e3
            end.record()
            torch.cuda.synchronize()
            per_call.append(f"{host:.3f}/{start.elapsed_time(end):.3f}")
        report(f"\n## {case}: host ms / event ms of 10 calls: {' '.join(per_call)}")
        work.copy_(shard)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
            # The barrier inside: the ranks start their profilers at different times.
            dist.barrier()
            torch.cuda.synchronize()
            ns(work, shape, dim, sizes)
            torch.cuda.synchronize()
        if rank != 0:
            continue
        kernels = sorted((e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        # The call's kernels: those after the barrier's (PyTorch's fill, then its all-reduce).
        fill = max((i for i, e in enumerate(kernels) if "at::native" in e.name), default=-1)
        kernels = kernels[fill + 1:]
        if world > 1 and kernels and "nccl" in kernels[0].name.lower():
            kernels = kernels[1:]
        origin = kernels[0].time_range.start
        print("start (us) | duration (us) | kernel")
        totals = collections.defaultdict(float)
        for e in kernels:
            duration = e.time_range.end - e.time_range.start
            totals[e.name[:70]] += duration
            print(f"{e.time_range.start - origin:10.1f} | {duration:8.1f} | {e.name[:110]}")
        print("totals (us):")
        for name, total in sorted(totals.items(), key=lambda item: -item[1]):
            print(f"{total:10.1f}  {name}")
        span = kernels[-1].time_range.end - origin
        print(f"span {span:.1f} us, {len(kernels)} kernels (overlapping ones counted each)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
