"""Small models on one GPU: the Muon step of GPT-2-class weights, many matrices with sides of
768 to 4096, where one product takes a few microseconds and kernel launches and host work weigh
as much as the flops. shardmuon.torch.Muon, eager and captured in a CUDA graph, and eager
with every matrix on its own (SHARDMUON_MAX_NS_BATCH=1, not the parameters of one shape as
strided batches), against torch.optim.Muon, in the same run, on the same inputs, each checked
against float64.

    python3 bench/bench_small_model.py [--model gpt2] [--weights bfloat16] [--repeats 20] [--out DIR]
    python3 bench/bench_small_model.py --device cpu --layers 1 --scale 8   # a smoke test

Per layer (nn.Linear's out x in): the attention's QKV 3d x d and output d x d, the MLP's
4d x d and d x 4d; gpt2 has d = 768 and 12 layers, gpt2-medium 1024 and 24, gpt2-xl 1600 and
48. Both optimizers iterate in bf16 (shardmuon with ns_dtype bf16 when the weights are
float32) with the settings of bench_param_dtypes.py: lr 0.02, momentum 0.95 with Nesterov,
weight decay 0.01 decoupled, (3.4445, -4.7750, 2.0315) x 5, the update scaled by
sqrt(max(1, rows / cols)).

Times, median over repeats after warm-ups: the step on the GPU (CUDA events around the call),
and on the host (until step() returns; when it is near the GPU's time, the GPU was waiting
for launches). The floor: the flops over the bf16 GEMM rate of an 8192^3 product measured at
the start, as bench_param_dtypes.py counts them (torch.optim.Muon's the plain iteration's,
K (4 s^2 L + 2 s^3) per matrix; shardmuon's those of its plan). It leaves out the launches
and the elementwise passes, and these small products run well below that rate (the rate of
the model's largest, d x 4d by 4d x d, is printed beside it).
Accuracy: after one step from the same state, every parameter's update against a float64
step, as a relative Frobenius error, the worst over the parameters.

With --split-qkv, the QKV weight is orthogonalized as three d x d matrices (query, key and
value each on its own, as modded-nanogpt does): one 3d x d parameter with muon_row_blocks = 3,
whose blocks share strided batches with the output projections (d x d too). torch.optim.Muon,
which takes no stacked parameters, is left out then.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, here)
import shardmuon.torch as st  # noqa: E402
from bench_param_dtypes import executed_floor_ms, random_state, reference_updates, worst_update_error  # noqa: E402
from bench_step import LR, MOMENTUM, STEPS, WEIGHT_DECAY, Report, standard_arguments  # noqa: E402

MODELS = {"gpt2": (768, 12), "gpt2-medium": (1024, 24), "gpt2-xl": (1600, 48)}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def layer_shapes(width):
    return [("attn.qkv", 3 * width, width), ("attn.out", width, width), ("mlp.up", 4 * width, width),
            ("mlp.down", width, 4 * width)]


def layer_matrices(width, split_qkv):
    """A layer's parameters as (name, rows, cols, blocks): each orthogonalized whole, or with
    split_qkv the QKV weight as 3 stacked d x d matrices."""
    return [(name, rows // 3, cols, 3) if split_qkv and name == "attn.qkv" else (name, rows, cols, 1)
            for name, rows, cols in layer_shapes(width)]


def median_times(device, warmups, repeats, prepare, run):
    """Median (GPU ms, host ms) of run(), each after prepare() and with the GPU idle."""
    gpu, host = [], []
    for i in range(warmups + repeats):
        prepare()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        run()
        returned = (time.perf_counter() - begin) * 1e3
        if device.type == "cuda":
            end.record()
            end.synchronize()
        if i >= warmups:
            gpu.append(start.elapsed_time(end) if device.type == "cuda" else returned)
            host.append(returned)
    return statistics.median(gpu), statistics.median(host)


def main():
    parser = standard_arguments(__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--layers", type=int, help="the model's own count unless given")
    parser.add_argument("--weights", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--split-qkv", action="store_true",
                        help="QKV as three stacked d x d matrices (muon_row_blocks = 3)")
    parser.set_defaults(repeats=20, warmups=3)
    args = parser.parse_args()

    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    width, layers = MODELS[args.model]
    layers = args.layers or layers
    width //= args.scale
    dtype = DTYPES[args.weights]
    # Per parameter: its matrices' shape and how many are stacked in its rows.
    stacks = [(f"layers.{layer}.{name}", rows, cols, blocks) for layer in range(layers)
              for name, rows, cols, blocks in layer_matrices(width, args.split_qkv)]
    shapes = [(name, rows, cols) for name, rows, cols, _ in stacks]
    blocks = [count for _, _, _, count in stacks]

    # The state and the float64 reference of every matrix, then stacked per parameter.
    matrices = [(name, rows, cols) for name, rows, cols, count in stacks for _ in range(count)]
    matrix_state = random_state(matrices, device, dtype)
    matrix_references = reference_updates(matrix_state, matrices)
    initial, references, first = [], [], 0
    for count in blocks:
        pieces = matrix_state[first:first + count]
        initial.append(tuple(torch.cat([piece[k] for piece in pieces]) for k in range(3)))
        references.append(torch.cat(matrix_references[first:first + count]))
        first += count
    params = [torch.nn.Parameter(w.clone()) for w, _, _ in initial]
    for p, count in zip(params, blocks):
        if count > 1:
            p.muon_row_blocks = count
    useful = sum(STEPS * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for _, r, c in matrices)
    product_dtype = torch.bfloat16 if device.type == "cuda" else dtype

    def gemm_rate(rows, inner):
        a = torch.randn(rows, inner, device=device).to(product_dtype)
        return 2 * rows * rows * inner / (median_times(device, 3, 20, lambda: None, lambda: a @ a.mT)[0] * 1e-3)

    square = 8192 // args.scale
    peak, model_rate = gemm_rate(square, square), gemm_rate(width, 4 * width)

    def reset(optimizer):
        """The initial state, written into the tensors a captured step reads."""
        for p, (w, g, m) in zip(params, initial):
            p.data.copy_(w)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            state = optimizer.state[p]
            if "momentum_buffer" in state:
                state["momentum_buffer"].copy_(m)
            else:
                state["momentum_buffer"] = m.clone()

    common = dict(lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY)
    ns_dtype = {"ns_dtype": torch.bfloat16} if dtype == torch.float32 else {}

    def shardmuon():
        return st.Muon(params, **common, coefficient_type="simple", num_ns_steps=STEPS,
                       scale_mode="shape_scaling", **ns_dtype)

    # (label, optimizer, captured, SHARDMUON_MAX_NS_BATCH): with a cap of 1 every matrix runs
    # on its own, as before parameters of one shape were batched.
    candidates = [("shardmuon", shardmuon, False, None),
                  ("shardmuon, one matrix per batch", shardmuon, False, "1")]
    if device.type == "cuda":
        candidates.append(("shardmuon, captured in a CUDA graph", shardmuon, True, None))
    if hasattr(torch.optim, "Muon") and not args.split_qkv:
        candidates.append(("torch.optim.Muon", lambda: torch.optim.Muon(params, **common, ns_steps=STEPS, eps=1e-7),
                           False, None))

    results = {}
    for label, make, captured, batch_cap in candidates:
        os.environ.pop("SHARDMUON_MAX_NS_BATCH", None)
        if batch_cap is not None:
            os.environ["SHARDMUON_MAX_NS_BATCH"] = batch_cap
        for p in params:
            p.grad = None
        optimizer = make()
        reset(optimizer)
        optimizer.step()  # the uncaptured step a capture needs first; a warm-up otherwise
        run = optimizer.step
        if captured:
            graph = torch.cuda.CUDAGraph()
            reset(optimizer)
            with torch.cuda.graph(graph):
                optimizer.step()
            run = graph.replay
        gpu_ms, host_ms = median_times(device, args.warmups, args.repeats, lambda: reset(optimizer), run)
        reset(optimizer)
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        floor = useful / peak * 1e3
        if isinstance(optimizer, st.Muon):  # the flops of the plan it ran
            floor = executed_floor_ms(optimizer, shapes, {"gemm_bf16": peak}, "bf16", blocks)
        results[label] = (gpu_ms, host_ms, floor, worst_update_error(params, initial, references))
    os.environ.pop("SHARDMUON_MAX_NS_BATCH", None)

    report = Report()
    emit = report.emit
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    split = ", QKV as 3 stacked matrices" if args.split_qkv else ""
    emit(f"# {args.model}: {len(matrices)} matrices ({layers} layers of width {width}{split}), {args.weights} "
         f"weights, 1 x {name}, torch {torch.__version__}")
    emit(f"GEMM rates measured: {peak / 1e12:.1f} TFLOP/s at {square}^3 (the floors'), {model_rate / 1e12:.1f} at "
         f"{width} x {4 * width} by {4 * width} x {width}; useful Newton-Schulz flops {useful / 1e9:.1f} GFLOP")
    emit("")
    baseline = results.get("torch.optim.Muon")
    emit("| optimizer | step (ms) | until step() returns (ms) | x torch.optim.Muon | floor (ms) | time / floor | "
         "us per matrix | worst update error vs float64 |")
    emit("|---|---|---|---|---|---|---|---|")
    for label, (gpu_ms, host_ms, floor, error) in results.items():
        ratio = f"{baseline[0] / gpu_ms:.2f}" if baseline else "-"
        emit(f"| {label} | {gpu_ms:.3f} | {host_ms:.3f} | {ratio} | {floor:.3f} | {gpu_ms / floor:.2f} | "
             f"{gpu_ms * 1e3 / len(matrices):.1f} | {error:.2e} |")
    report.save(args.out, f"bench_small_model_{args.model}_{args.weights}{'_split_qkv' if args.split_qkv else ''}.md")


if __name__ == "__main__":
    main()
