"""Where one Muon step's GPU time goes: the kernels of a shardmuon step of a GPT-2-class model
on one GPU (the models of bench_small_model.py, or any width and depth), grouped by what they
do, from torch.profiler over replays of the step captured in a CUDA graph. A tool for tuning,
not a benchmark of record: the profiler's own overhead is in the times, and the step's time
beside them is measured without it (CUDA events, median).

    python3 bench/profile_step.py [--model gpt2-xl] [--width W --layers L] [--weights bfloat16]
                                  [--split-qkv] [--top 12] [--out DIR]

The GEMMs' rate is the flops shardmuon executed under the step's plan (counted as
bench_param_dtypes.py counts them: one triangle of the symmetric products) over the GEMM
kernels' time, beside the rate of an 8192^3 product measured in the same run.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, here)
import shardmuon.torch as st  # noqa: E402
from bench_param_dtypes import executed_floor_ms  # noqa: E402
from bench_small_model import DTYPES, MODELS, layer_matrices, median_times  # noqa: E402
from bench_step import LR, MOMENTUM, STEPS, WEIGHT_DECAY, Report  # noqa: E402

# (what the kernels do, substrings of their names), the first match counts.
CATEGORIES = [
    ("GEMMs (cuBLASLt)", ("nvjet", "gemm", "xmma", "cutlass")),
    ("mirror of the symmetric products", ("mirror_lower",)),
    ("unpacking of summed Grams", ("unpack_symmetric",)),
    ("momentum pass", ("momentum_kernel",)),
    ("update pass", ("update_kernel",)),
    ("commit of a checked step", ("commit_kernel",)),
    ("finite checks", ("flag_nonfinite", "count_if_flagged")),
    ("Frobenius normalization", ("sum_of_squares", "sum_partials", "divide_by_norm")),
    ("copies and fills", ("copy", "Memcpy", "Memset", "fill")),
]


# PyTorch (2.11 on the lent machines) warns that its profiler "clears events at the end of each
# cycle" even where no schedule makes cycles, as here (a bug, fixed upstream in
# pytorch/pytorch#180387): a line of noise in every profile.
warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)


def category(kernel: str) -> str:
    for label, keys in CATEGORIES:
        if any(key in kernel for key in keys):
            return label
    return "other"


def main():
    args = arguments().parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    width, layers = MODELS[args.model]
    width, layers = args.width or width, args.layers or layers
    dtype = DTYPES[args.weights]
    stacks = [(f"layers.{layer}.{name}", rows, cols, blocks) for layer in range(layers)
              for name, rows, cols, blocks in layer_matrices(width, args.split_qkv)]
    generator = torch.Generator(device=device).manual_seed(0)
    params = []
    for _, rows, cols, blocks in stacks:
        p = torch.nn.Parameter((0.02 * torch.randn(rows * blocks, cols, device=device, generator=generator)).to(dtype))
        p.grad = torch.randn(p.shape, device=device, generator=generator).to(dtype)
        if blocks > 1:
            p.muon_row_blocks = blocks
        params.append(p)
    ns_dtype = {"ns_dtype": torch.bfloat16} if dtype == torch.float32 else {}
    optimizer = st.Muon(params, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY,
                        coefficient_type="simple", num_ns_steps=STEPS, scale_mode="shape_scaling", **ns_dtype)

    eager_ms, _ = median_times(device, 3, args.repeats, lambda: None, optimizer.step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        optimizer.step()
    captured_ms, _ = median_times(device, 3, args.repeats, lambda: None, graph.replay)

    square = torch.randn(8192, 8192, device=device).to(torch.bfloat16)
    peak = 2 * 8192**3 / (median_times(device, 3, 20, lambda: None, lambda: square @ square.mT)[0] * 1e-3)
    shapes = [(name, rows, cols) for name, rows, cols, _ in stacks]
    blocks = [count for _, _, _, count in stacks]
    executed_flops = executed_floor_ms(optimizer, shapes, {"gemm_bf16": 1e12}, "bf16", blocks) * 1e9

    steps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    by_kernel = collections.defaultdict(lambda: [0, 0.0])  # name: [launches, us]
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kernel[event.name][0] += 1
            by_kernel[event.name][1] += event.device_time_total
    by_category = collections.defaultdict(lambda: [0, 0.0])
    for kernel, (launches, us) in by_kernel.items():
        by_category[category(kernel)][0] += launches
        by_category[category(kernel)][1] += us
    kernel_ms = sum(us for _, us in by_kernel.values()) / steps / 1e3

    report = Report()
    emit = report.emit
    split = ", QKV as 3 stacked matrices" if args.split_qkv else ""
    emit(f"# {len(stacks)} parameters ({layers} layers of width {width}{split}), {args.weights} weights, "
         f"1 x {torch.cuda.get_device_name()}, torch {torch.__version__}")
    emit(f"step: {eager_ms:.3f} ms eager, {captured_ms:.3f} ms captured; kernels under the profiler "
         f"{kernel_ms:.3f} ms per step")
    gemm_ms = by_category["GEMMs (cuBLASLt)"][1] / steps / 1e3
    emit(f"GEMMs: {executed_flops / 1e12:.2f} TFLOP executed in {gemm_ms:.3f} ms, "
         f"{executed_flops / (gemm_ms * 1e-3) / 1e12:.0f} TFLOP/s against {peak / 1e12:.0f} at 8192^3")
    emit("")
    emit("| what | ms per step | share of the kernels | launches per step |")
    emit("|---|---|---|---|")
    for label, (launches, us) in sorted(by_category.items(), key=lambda item: -item[1][1]):
        emit(f"| {label} | {us / steps / 1e3:.3f} | {100 * us / steps / 1e3 / kernel_ms:.1f}% | "
             f"{launches / steps:.0f} |")
    emit("")
    emit("| kernel | us per step | launches per step | us each |")
    emit("|---|---|---|---|")
    for kernel, (launches, us) in sorted(by_kernel.items(), key=lambda item: -item[1][1])[:args.top]:
        emit(f"| {kernel[:110]} | {us / steps:.1f} | {launches / steps:.0f} | {us / launches:.1f} |")
    report.save(args.out, f"profile_step_w{width}_x{layers}_{args.weights}{'_split_qkv' if args.split_qkv else ''}.md")


def arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-xl")
    parser.add_argument("--width", type=int, help="the model's own unless given")
    parser.add_argument("--layers", type=int, help="the model's own unless given")
    parser.add_argument("--weights", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--split-qkv", action="store_true",
                        help="QKV as three stacked d x d matrices (muon_row_blocks = 3)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="how many kernels to list")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    return parser


if __name__ == "__main__":
    main()
