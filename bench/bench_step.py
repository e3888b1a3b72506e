"""Whole optimizer step on the layer shapes of a Llama-3-8B-class model, tensor-parallel over the
GPUs of one machine: shardmuon.torch.Muon against the two loops PyTorch users run today, in the
same run, on the same inputs, with every result checked against float64.

    torchrun --nproc_per_node=2 bench/bench_step.py [--layers 8] [--repeats 5] [--out DIR]
    python3 bench/bench_step.py --device cpu --scale 64 --layers 2   # a smoke test, no GPU

Per layer: QKV 6144 x 4096 and gate+up 28672 x 4096 (column-parallel: rows split), out
4096 x 4096 and down 4096 x 14336 (row-parallel: columns split); bf16 on the GPU. Rows:
  - shardmuon: Muon steps with algorithm auto (the step's planner), owner, gram_allreduce,
    and gram_newton_schulz;
  - gram loop: per parameter, momentum, the per-iteration Gram all-reduce Newton-Schulz on
    long-side shards (one all_to_all each way for short-side shards), the update;
  - all-gather loop: per parameter, momentum, all-gather, Newton-Schulz of the whole matrix on
    every rank, keep the own shard, the update.
Times: one step, warm-ups, median over repeats, the slowest rank's. The floor is the useful
Newton-Schulz flops, K (4 s^2 L + 2 s^3) per matrix, over the GPUs' GEMM rate measured at the
start. Accuracy: after one step from the same state, every parameter against a float64 step
of the gathered matrices (relative Frobenius error, the worst over parameters).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, here)
import shardmuon.torch as st  # noqa: E402
from bench_newton_schulz import (even_split, gather_shards, gram_all_reduce_newton_schulz,  # noqa: E402
                                 exchange_blocks, offsets_of, torch_newton_schulz)

LAYER = [("qkv", 6144, 4096, 0), ("out", 4096, 4096, 1), ("gate_up", 28672, 4096, 0),
         ("down", 4096, 14336, 1)]
LR, MOMENTUM, WEIGHT_DECAY, STEPS = 0.02, 0.95, 0.01, 5


def scale(rows, cols):
    return max(rows, cols) ** 0.5  # spectral, shardmuon's default


class Clock:
    """CUDA events on the GPU, the host clock on the CPU."""

    def __init__(self, device, world, warmups, repeats):
        self.device, self.world, self.warmups, self.repeats = device, world, warmups, repeats

    def median_ms(self, prepare, run):
        times = []
        for i in range(self.warmups + self.repeats):
            prepare()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            if self.world > 1:
                dist.barrier()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                begin = time.perf_counter()
                run()
                elapsed = (time.perf_counter() - begin) * 1e3
            if i >= self.warmups:
                times.append(elapsed)
        median = torch.tensor(statistics.median(times), device=self.device)
        if self.world > 1:
            dist.all_reduce(median, op=dist.ReduceOp.MAX)
        return float(median)


def standard_arguments(description, layers=None):
    """The arguments the one-machine benchmarks share (and --layers where given a default)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if layers is not None:
        parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--scale", type=int, default=1, help="divide every extent by this (smoke tests)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    return parser


class Report:
    """Lines printed as they come (on the reporting rank) and written to a Markdown file."""

    def __init__(self, reporting=True):
        self.reporting, self.lines = reporting, []

    def emit(self, text):
        if self.reporting:
            print(text, flush=True)
            self.lines.append(text)

    def save(self, directory, name):
        if self.reporting:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, name), "w") as f:
                f.write("\n".join(self.lines) + "\n")


def state_resetter(params, initial):
    """A function that puts every parameter back to its initial (weight, gradient) and, given
    an optimizer, its momentum: the same state before every timed step."""
    def reset(optimizer=None):
        for p, (w, g, m) in zip(params, initial):
            p.data.copy_(w)
            p.grad = g
            if optimizer is not None:
                optimizer.state[p]["momentum_buffer"] = m.clone()
    return reset


def baseline_step(params, grads, momenta, shapes, coefficients, world, rank, gather):
    """One Muon step in PyTorch per parameter (TE's lerp momentum, Nesterov, decoupled decay)."""
    for p, g, m, (name, rows, cols, dim, sizes) in zip(params, grads, momenta, shapes):
        m.lerp_(g, 1 - MOMENTUM)
        update = g.lerp(m, MOMENTUM)
        if gather:
            whole = gather_shards(update, dim, sizes, world) if world > 1 else update
            result = torch_newton_schulz(whole, coefficients, update.dtype)
            result = result.narrow(dim, offsets_of(sizes)[rank], sizes[rank]) if world > 1 else result
        else:
            long_dim = 1 if cols >= rows else 0
            if world == 1 or dim == long_dim:
                wide = update if long_dim == 1 else update.mT
                result = gram_all_reduce_newton_schulz(wide, coefficients) if world > 1 else \
                    torch_newton_schulz(wide, coefficients, update.dtype)
                result = result if long_dim == 1 else result.mT
            else:
                long_sizes = even_split((rows, cols)[long_dim], world)
                block = exchange_blocks(update, 1 - dim, long_sizes, dim, sizes, rank)
                wide = block if long_dim == 1 else block.mT
                result = gram_all_reduce_newton_schulz(wide, coefficients)
                result = result if long_dim == 1 else result.mT
                result = exchange_blocks(result.contiguous(), dim, sizes, 1 - dim, long_sizes, rank)
        p.mul_(1 - LR * WEIGHT_DECAY).add_(result.to(p.dtype), alpha=-LR * scale(rows, cols))


def main():
    args = standard_arguments(__doc__, layers=8).parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        # Ranks may share a GPU (scripts/rank_host_id.sh), to check the 2-rank path on one GPU.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        device, dtype = torch.device("cpu"), torch.float32
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    group = dist.group.WORLD if world > 1 else None
    clock = Clock(device, world, args.warmups, args.repeats)
    coefficients = st.NewtonSchulz(ns_steps=STEPS).coefficients()

    # The parameters: the same random whole matrices on every rank, each rank keeps its shard.
    generator = torch.Generator(device=device).manual_seed(1234)
    shapes, wholes = [], []
    for layer in range(args.layers):
        for name, rows, cols, dim in LAYER:
            rows, cols = rows // args.scale, cols // args.scale
            sizes = even_split((rows, cols)[dim], world)
            shapes.append((f"layers.{layer}.{name}", rows, cols, dim, sizes))
            w = 0.02 * torch.randn(rows, cols, device=device, generator=generator)
            g = torch.randn(rows, cols, device=device, generator=generator)
            m = 0.1 * torch.randn(rows, cols, device=device, generator=generator)
            wholes.append((w.to(dtype), g.to(dtype), m.to(dtype)))

    def shard(x, dim, sizes):
        return x.narrow(dim, offsets_of(sizes)[rank], sizes[rank]).contiguous() if world > 1 else x.clone()

    initial = [tuple(shard(x, dim, sizes) for x in whole) for whole, (_, _, _, dim, sizes) in zip(wholes, shapes)]
    useful = sum(STEPS * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for _, r, c, _, _ in shapes)
    a = torch.randn(8192 // args.scale, 8192 // args.scale, device=device).to(dtype)
    gemm_ms = clock.median_ms(lambda: None, lambda: a @ a)
    gemm_rate = 2 * a.shape[0] ** 3 / (gemm_ms * 1e-3)
    floor_ms = useful / (world * gemm_rate) * 1e3

    # The float64 reference of one step, per matrix on the gathered values.
    references = []
    for (w, g, m), (name, rows, cols, dim, sizes) in zip(wholes, shapes):
        w, g, m = w.double(), g.double(), m.double()
        m = m.lerp(g, 1 - MOMENTUM)
        update = torch_newton_schulz(g.lerp(m, MOMENTUM), coefficients, torch.float64)
        references.append(w * (1 - LR * WEIGHT_DECAY) - LR * scale(rows, cols) * update)

    def worst_error(params):
        worst = 0.0
        for p, reference, (name, rows, cols, dim, sizes) in zip(params, references, shapes):
            whole = gather_shards(p.detach(), dim, sizes, world) if world > 1 else p.detach()
            worst = max(worst, float((whole.double() - reference).norm() / reference.norm()))
        return worst

    report = Report(reporting=rank == 0)
    emit = report.emit
    emit(f"# whole-step benchmark: {args.layers} layers, {len(shapes)} matrices, {world} x "
         f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, {dtype}, scale 1/{args.scale}")
    emit(f"GEMM rate measured: {gemm_rate / 1e12:.1f} TFLOP/s per device; useful Newton-Schulz "
         f"flops {useful / 1e12:.1f} TFLOP; floor {floor_ms:.1f} ms")
    emit("")
    emit("| method | step (ms) | x gram loop | x all-gather loop | time / floor | worst error vs float64 |")
    emit("|---|---|---|---|---|---|")

    results = {}
    params = [torch.nn.Parameter(w.clone()) for w, _, _ in initial]
    reset = state_resetter(params, initial)

    for loop, gather in (("gram loop", False), ("all-gather loop", True)):
        momenta = [m.clone() for _, _, m in initial]

        def prepare():
            reset()
            for momentum, (_, _, m) in zip(momenta, initial):
                momentum.copy_(m)

        def run():
            with torch.no_grad():
                baseline_step(params, [p.grad for p in params], momenta, shapes, coefficients, world, rank, gather)

        results[loop] = clock.median_ms(prepare, run)
        prepare()
        run()
        results[loop + " error"] = worst_error(params)

    for algorithm in ("auto", "owner", "gram_allreduce", "gram_newton_schulz"):
        for p, (_, _, _, dim, _) in zip(params, shapes):
            p.partition_dim = dim if world > 1 else -1
        optimizer = st.Muon(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                            num_ns_steps=STEPS, process_group=group, algorithm=algorithm)
        milliseconds = clock.median_ms(lambda: reset(optimizer), optimizer.step)
        reset(optimizer)
        optimizer.step()
        error = worst_error(params)
        emit(f"| shardmuon, {algorithm} | {milliseconds:.2f} | {results['gram loop'] / milliseconds:.2f} | "
             f"{results['all-gather loop'] / milliseconds:.2f} | {milliseconds / floor_ms:.2f} | {error:.2e} |")
    for loop in ("gram loop", "all-gather loop"):
        emit(f"| PyTorch {loop} | {results[loop]:.2f} | | | {results[loop] / floor_ms:.2f} | "
             f"{results[loop + ' error']:.2e} |")
    report.save(args.out, f"bench_step_{world}{device.type}.md")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
