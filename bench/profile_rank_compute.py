"""The kernels of one rank's Newton-Schulz in a group of P, on one GPU: rank 0's block of an
s x L matrix split along its long side over P ranks, through the library's C API with a
callback communicator whose collectives do nothing (the stand-in of bench_rank_compute.cu).
For each algorithm: the median time of a call (CUDA events; the algorithms' calls
interleaved), then one call under torch.profiler: its kernels summed by name, and the time of
the products and of the other kernels.

    SHARDMUON_LIBRARY=build-gpu/libshardmuon.so python3 bench/profile_rank_compute.py \\
        --cases 8192x8192:2,4096x4096:2 [--algorithms gram_allreduce,gram_applied_twice]

Without the sums the iterates are rank 0's own (see bench_rank_compute.cu), so nothing is
checked against a reference; the products, passes and their shapes are rank 0's in a real
group. One difference from NCCL: a callback communicator sums the Gram in float32, so the
pass unpacking it reads twice the bytes it reads after an NCCL (bf16) sum.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import functools
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from shardmuon import _capi as c  # noqa: E402
from bench_newton_schulz import Timer  # noqa: E402


# PyTorch (2.11 on the lent machines) warns that its profiler "clears events at the end of each
# cycle" even where no schedule makes cycles, as here (a bug, fixed upstream in
# pytorch/pytorch#180387): a line of noise in every profile.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)


class StandInGroup:
    """Rank 0 of a group of `ranks` whose collectives leave their buffers as they are."""

    def __init__(self, ranks):
        def nothing(*args):
            return 0

        # The C function pointers must live as long as the communicator.
        self.functions = (c.ALL_REDUCE_SUM(nothing), c.ALL_GATHER(nothing), c.ALL_TO_ALL(nothing),
                          c.AGREE_MAX(nothing))
        table = c.CommCallbacks(None, 0, ranks, *self.functions)
        self.handle = ctypes.c_void_p()
        c.check(c.lib.shardmuon_comm_create_callbacks(ctypes.byref(table), c.BACKEND_CUDA,
                                                      ctypes.byref(self.handle)))

    def __del__(self):
        c.lib.shardmuon_comm_destroy(self.handle)


def is_product(name):
    """cuBLASLt's GEMM kernels (Hopper's nvjet and CUTLASS ones)."""
    return any(key in name for key in ("nvjet", "gemm", "cutlass", "sm90_xmma"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="8192x8192:2", help="SxL:P,... (s <= L)")
    parser.add_argument("--algorithms", default="gram_allreduce,gram_applied_twice")
    parser.add_argument("--schedule", default="quintic")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_rank_compute.py: needs a CUDA GPU (torch.cuda.is_available() is False)")

    context = ctypes.c_void_p()
    c.check(c.lib.shardmuon_context_create(c.BACKEND_CUDA, 0, ctypes.byref(context)))
    stream = torch.cuda.current_stream()
    for case in args.cases.split(","):
        shape, ranks = case.split(":")
        s, length = (int(x) for x in shape.split("x"))
        ranks = int(ranks)
        sizes = [length // ranks + (1 if r < length % ranks else 0) for r in range(ranks)]
        array = (ctypes.c_int64 * ranks)(*sizes)
        layout = c.Layout(s, length, c.SHARDED_DIM1, ranks, array)
        group = StandInGroup(ranks)
        torch.manual_seed(0)
        source = torch.randn(s, sizes[0], device="cuda").bfloat16()
        block = torch.empty_like(source)
        algorithms = args.algorithms.split(",")
        calls = []
        for algorithm in algorithms:
            options = c.NsOptions()
            c.check(c.lib.shardmuon_ns_options_default(ctypes.byref(options)))
            options.schedule = c.SCHEDULES[args.schedule]
            options.num_iterations = args.steps
            options.algorithm = c.ALGORITHMS[algorithm]
            calls.append(functools.partial(
                c.lib.shardmuon_newton_schulz, context, group.handle, ctypes.c_void_p(block.data_ptr()),
                c.BFLOAT16, ctypes.byref(layout), ctypes.byref(options), ctypes.c_void_p(stream.cuda_stream)))
        # The algorithms' calls interleaved, one of each a round (3 warm-up rounds, the median of
        # 15), so that the GPU's clock, falling as it heats, weighs on them alike.
        medians = Timer(warmups=3, repeats=15, world=1).medians_ms(
            [(lambda: block.copy_(source), lambda call=call: c.check(call())) for call in calls])
        median = dict(zip(algorithms, medians))
        for algorithm, call in zip(algorithms, calls):
            block.copy_(source)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
                c.check(call())
                torch.cuda.synchronize()
            kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            totals, counts = collections.defaultdict(float), collections.Counter()
            for e in kernels:
                totals[e.name[:90]] += e.time_range.end - e.time_range.start
                counts[e.name[:90]] += 1
            products = sum(t for name, t in totals.items() if is_product(name))
            passes = sum(t for name, t in totals.items() if not is_product(name))
            print(f"\n## {s}x{length} over {ranks} (block {s}x{sizes[0]}), {algorithm}: "
                  f"median {median[algorithm]:.3f} ms; profiled call: products "
                  f"{products / 1e3:.3f} ms, other kernels {passes / 1e3:.3f} ms, {len(kernels)} kernels")
            print("| total (us) | launches | kernel |\n|---|---|---|")
            for name, total in sorted(totals.items(), key=lambda item: -item[1]):
                print(f"| {total:.1f} | {counts[name]} | {name} |")
            # An iteration's worth of kernels in order, past the first iteration's (which also
            # takes the norm); not aligned to an iteration's start, but each product in its place.
            ordered = sorted(kernels, key=lambda e: e.time_range.start)
            per_iteration = len(ordered) // args.steps
            print(f"kernels {per_iteration + 1} to {2 * per_iteration} of the call, in order:")
            for e in ordered[per_iteration:2 * per_iteration]:
                print(f"  {e.time_range.end - e.time_range.start:8.1f} us  {e.name[:100]}")
    c.lib.shardmuon_context_destroy(context)


if __name__ == "__main__":
    main()
