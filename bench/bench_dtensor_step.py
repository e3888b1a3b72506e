"""One optimizer step of the weights of FSDP2 + tensor parallelism (torchtitan's 2D
parallelism) on a (dp, tp) device mesh, as DTensors: the column-parallel weights (QKV, gate+up)
placed (Shard(0), Shard(0)), which the step takes as they are, and the row-parallel ones (out,
down) placed (Shard(0), Shard(1)), which it redistributes to rows first. All are stepped over
the mesh's every rank. Compares, in the same run on the same inputs:

  - redistribution_bytes=0: each redistributed weight in a library call of its own (how the
    front end stepped them before the seventeenth session);
  - the default budget (1 GiB): they join the one call of the group, so that the planner
    shares out all of its matrices (owners).

With --pp P > 1 the mesh is (pp, dp, tp) and the weights live on its (dp, tp) half (a
pipeline stage's), whose ranks no process group holds: the step first gathers over dp and
the dp ranks repeat the orthogonalization; then, after mesh["dp", "tp"]._flatten(), it steps
over the (dp, tp) ranks again.

    torchrun --nproc_per_node=4 bench/bench_dtensor_step.py --device cpu --scale 16   # gloo
    torchrun --nproc_per_node=8 bench/bench_dtensor_step.py --device cpu --scale 16 --pp 2
    torchrun --nproc_per_node=4 bench/bench_dtensor_step.py                         # 4 GPUs
    torchrun --nproc_per_node=4 --no-python scripts/rank_host_id.sh python3 \
        bench/bench_dtensor_step.py     # 4 ranks sharing one GPU over NCCL (checks only)

Per layer, Llama-3-8B's shapes over --scale: QKV 6144 x 4096, out 4096 x 4096, gate+up
28672 x 4096, down 4096 x 14336 (bf16 on GPUs, float32 on the CPU). Times: one step, warm-ups,
median over repeats, the slowest rank's (CUDA events on GPUs, the host clock on the CPU).
Calls: the library step calls a step makes. Plan: the algorithms plan() chose. Floor: the
useful flops, K (4 s^2 L + 2 s^3) per matrix, over the (dp, tp) ranks at the GEMM rate
measured at the start (a square product larger than the caches). Error: after
one step from zero momentum, the worst relative Frobenius error over the weights against a
float64 step of the whole matrices; a row beyond 3e-2 (bf16) or 1e-4 (float32) fails the run.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

import torch
import torch.distributed as dist

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(here, "..", "python"), os.path.join(here, "..", "python", "tests"), here]
import reference  # noqa: E402
import shardmuon.torch as st  # noqa: E402
from bench_step import LAYER, Clock  # noqa: E402
from shardmuon import _capi  # noqa: E402

LR, WEIGHT_DECAY = 0.02, 0.01


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--scale", type=int, default=1, help="divide every extent by this")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mesh", default="2x2", help="dp x tp")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (a mesh dimension before dp)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmups", type=int, default=2)
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if args.device == "cuda":
        # Ranks may share a GPU (scripts/rank_host_id.sh), to check a mesh's steps on one GPU.
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        dist.init_process_group("nccl", device_id=device)
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    dp, tp = (int(x) for x in args.mesh.split("x"))
    root = init_device_mesh(device.type, (args.pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    mesh = root["dp", "tp"]
    clock = Clock(device, world, args.warmups, args.repeats)

    # The same whole matrices on every rank (CPU generator), each rank keeps its pieces.
    generator = torch.Generator().manual_seed(1234)
    wholes = []
    for layer in range(args.layers):
        for name, rows, cols, dim in LAYER:
            rows, cols = rows // args.scale, cols // args.scale
            w = 0.02 * torch.randn(rows, cols, generator=generator, dtype=torch.float64)
            g = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
            placements = [Shard(0), Shard(0) if dim == 0 else Shard(1)]
            wholes.append((f"layers.{layer}.{name}", w.to(dtype), g.to(dtype), placements))
    references = [reference.muon_step(w, g, torch.zeros_like(w, dtype=torch.float64), lr=LR,
                                      weight_decay=WEIGHT_DECAY)[0] for _, w, g, _ in wholes]

    calls = []
    library_step = _capi.lib.shardmuon_muon_step

    def counted(*arguments):
        calls.append(arguments[3])
        return library_step(*arguments)

    _capi.lib.shardmuon_muon_step = counted

    def emit(text):
        if rank == 0:
            print(text, flush=True)

    # The floor: the useful Newton-Schulz flops, K (4 s^2 L + 2 s^3) per s x L matrix (s <= L),
    # shared out evenly over the (dp, tp) ranks, at the GEMM rate of one rank measured here
    # with every rank multiplying at once (on the CPU, one thread each, as in the step).
    useful = sum(5 * (4 * min(w.shape) ** 2 * max(w.shape) + 2 * min(w.shape) ** 3) for _, w, _, _ in wholes)
    side = 8192 if device.type == "cuda" else 2048  # larger than the caches
    a = torch.randn(side, side, device=device).to(dtype)
    gemm_rate = 2 * side ** 3 / (clock.median_ms(lambda: None, lambda: a @ a) * 1e-3)
    floor_ms = useful / (dp * tp * gemm_rate) * 1e3

    emit(f"# DTensor step: {args.layers} layers, {len(wholes)} weights, mesh {args.pp} x {dp} x {tp} on "
         f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (gloo)'}, {dtype}, "
         f"scale 1/{args.scale}")
    emit(f"GEMM rate measured: {gemm_rate / 1e9:.1f} GFLOP/s per rank; useful Newton-Schulz flops "
         f"{useful / 1e9:.1f} GFLOP; floor over the {dp * tp} (dp, tp) ranks {floor_ms:.2f} ms")
    emit("")
    emit("| (dp, tp) group | redistribution_bytes | calls per step | plan | step (ms) | x first row | "
         "time / floor | worst error vs float64 |")
    emit("|---|---|---|---|---|---|---|---|")
    baseline = None
    # The tolerances of bench_newton_schulz.py: a row outside its dtype's fails the run.
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    failures = 0
    runs = [("world", 0), ("world", 1 << 30)]
    if args.pp > 1:
        runs = [("none: gathered", 1 << 30), ("flattened", 0), ("flattened", 1 << 30)]
    for group, budget in runs:
        if group == "flattened" and not root._flatten_mapping:
            mesh._flatten()  # every rank, before the optimizer looks for the group
        params = []
        for name, w, g, placements in wholes:
            p = torch.nn.Parameter(distribute_tensor(w.to(device), mesh, placements))
            p.grad = distribute_tensor(g.to(device), mesh, placements)
            params.append((name, p))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the gathered split's note (the first row with --pp)
            optimizer = st.Muon(params, lr=LR, weight_decay=WEIGHT_DECAY, redistribution_bytes=budget)
            plan = collections.Counter(x["algorithm"] for x in optimizer.plan().values())
        calls.clear()
        optimizer.step()  # from zero momentum, as the reference
        per_step = len(calls)
        error = max(float(reference.relative_error(p.full_tensor().double().cpu(), expected))
                    for (_, p), expected in zip(params, references))
        failures += 0 if error < tolerance else 1
        milliseconds = clock.median_ms(lambda: None, optimizer.step)
        baseline = baseline or milliseconds
        summary = ", ".join(f"{name} x {count}" for name, count in sorted(plan.items()))
        emit(f"| {group} | {budget} | {per_step} | {summary} | {milliseconds:.2f} | "
             f"{baseline / milliseconds:.2f} | {milliseconds / floor_ms:.2f} | {error:.2e} |")
    emit("")
    emit(f"accuracy: {failures} row(s) outside the tolerance ({tolerance:.0e})")
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
