"""float32 weights, as mixed-precision training keeps them: the Muon step on one GPU with the
Newton-Schulz iteration in float32 (shardmuon's default, the parameter's dtype) and in bf16
(``ns_dtype=torch.bfloat16``, what torch.optim.Muon does with any weights), and as
``TorchMuon`` given torch.optim.Muon's arguments (the same bf16 step), against
torch.optim.Muon itself, in the same run, on the same inputs, each checked against float64.

    python3 bench/bench_param_dtypes.py [--layers 2] [--repeats 5] [--out DIR]
    python3 bench/bench_param_dtypes.py --device cpu --scale 32 --layers 1   # a smoke test

Per layer the Llama-3-8B shapes of bench_step.py (QKV 6144 x 4096, out 4096 x 4096, gate+up
28672 x 4096, down 4096 x 14336), float32 weights, gradients and momentum. The settings both
optimizers take: lr 0.02, momentum 0.95 with Nesterov, weight decay 0.01 decoupled, the
iteration (3.4445, -4.7750, 2.0315) x 5 (shardmuon's "simple"), the update scaled by
sqrt(max(1, rows / cols)) (shardmuon's "shape_scaling", torch.optim.Muon's default).
Times: one optimizer step, warm-ups, median over repeats (CUDA events). Two floors, each
flops over the GEMM rate of the iteration's dtype measured at the start (bf16: 8192^3;
float32: 4096^3, no TF32): the plain iteration's, K (4 s^2 L + 2 s^3) per matrix, which
torch.optim.Muon runs; and, for shardmuon's rows, the flops it executes (one triangle of the
symmetric products, Gram Newton-Schulz where the step's plan says so), counted as
bench_newton_schulz.py counts them. Accuracy: after one step
from the same state, every parameter's update (new weights minus old) against a float64 step,
as a relative Frobenius error, the worst over the parameters.
"""

from __future__ import annotations

import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, here)
import shardmuon.torch as st  # noqa: E402
from bench_newton_schulz import floor_ms, torch_newton_schulz  # noqa: E402
from bench_step import LAYER, LR, MOMENTUM, STEPS, WEIGHT_DECAY, Clock, Report, standard_arguments  # noqa: E402

COEFFICIENTS = [(3.4445, -4.7750, 2.0315)] * STEPS


def shape_scaling(rows, cols):
    return max(1.0, rows / cols) ** 0.5


def random_state(shapes, device, dtype):
    """(weight, gradient, momentum) of every (name, rows, cols), the same for every candidate."""
    generator = torch.Generator(device=device).manual_seed(2024)
    state = []
    for _, rows, cols in shapes:
        w = 0.02 * torch.randn(rows, cols, device=device, generator=generator)
        g = torch.randn(rows, cols, device=device, generator=generator)
        m = 0.1 * torch.randn(rows, cols, device=device, generator=generator)
        state.append((w.to(dtype), g.to(dtype), m.to(dtype)))
    return state


def reference_updates(initial, shapes):
    """Every parameter's update (new weight minus old) in a float64 step from `initial`."""
    references = []
    for (w, g, m), (_, rows, cols) in zip(initial, shapes):
        w, g, m = w.double(), g.double(), m.double()
        m = m.lerp(g, 1 - MOMENTUM)
        orthogonal = torch_newton_schulz(g.lerp(m, MOMENTUM), COEFFICIENTS, torch.float64)
        references.append(-LR * WEIGHT_DECAY * w - LR * shape_scaling(rows, cols) * orthogonal)
    return references


def worst_update_error(params, initial, references):
    """The largest relative Frobenius error of a parameter's update against its reference."""
    return max(float(((p.detach().double() - w.double()) - r).norm() / r.norm())
               for p, (w, _, _), r in zip(params, initial, references))


def executed_floor_ms(optimizer, shapes, rates, dtype_name, blocks=None):
    """The GEMM flops shardmuon ran under the step's plan (one triangle of the symmetric
    products, Gram Newton-Schulz where planned) over `rates`, as bench_newton_schulz.py counts
    them, summed over the matrices: one per parameter, or blocks[i] of shapes[i] stacked."""
    blocks = blocks or [1] * len(shapes)
    return sum(count * floor_ms(min(r, c), max(r, c), STEPS, rates, dtype_name, 1, "local",
                                plan["gram_iteration"])[0]
               for (_, r, c), count, plan in zip(shapes, blocks, optimizer.plan().values()))


def main():
    args = standard_arguments(__doc__, layers=2).parse_args()

    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    clock = Clock(device, 1, args.warmups, args.repeats)

    shapes = [(f"layers.{layer}.{name}", rows // args.scale, cols // args.scale)
              for layer in range(args.layers) for name, rows, cols, _ in LAYER]
    initial = random_state(shapes, device, torch.float32)
    useful = sum(STEPS * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for _, r, c in shapes)
    rates = {}
    for dtype, n in ((torch.bfloat16, 8192), (torch.float32, 4096)):
        n //= args.scale
        a = torch.randn(n, n, device=device).to(dtype)
        rates[dtype] = 2 * n**3 / (clock.median_ms(lambda: None, lambda: a @ a) * 1e-3)

    references = reference_updates(initial, shapes)
    params = [torch.nn.Parameter(w.clone()) for w, _, _ in initial]

    def reset(optimizer):
        for p, (w, g, m) in zip(params, initial):
            p.data.copy_(w)
            p.grad = g.clone()
            optimizer.state[p]["momentum_buffer"] = m.clone()

    common = dict(lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY)
    candidates = [("shardmuon, ns_dtype float32 (default)", torch.float32,
                   lambda: st.Muon(params, **common, coefficient_type="simple", num_ns_steps=STEPS,
                                   scale_mode="shape_scaling")),
                  ("shardmuon, ns_dtype bf16", torch.bfloat16,
                   lambda: st.Muon(params, **common, coefficient_type="simple", num_ns_steps=STEPS,
                                   scale_mode="shape_scaling", ns_dtype=torch.bfloat16)),
                  ("shardmuon TorchMuon, torch.optim.Muon's arguments", torch.bfloat16,
                   lambda: st.TorchMuon(params, **common, ns_steps=STEPS, eps=1e-7))]
    if hasattr(torch.optim, "Muon"):
        candidates.append(("torch.optim.Muon", torch.bfloat16,
                           lambda: torch.optim.Muon(params, **common, ns_steps=STEPS, eps=1e-7)))

    results = {}
    for label, ns_dtype, make in candidates:
        optimizer = make()
        ms = clock.median_ms(lambda: reset(optimizer), optimizer.step)
        reset(optimizer)
        optimizer.step()
        executed = None
        if isinstance(optimizer, st.Muon):  # the flops of the plan it ran
            rate_names = {"gemm_bf16": rates[torch.bfloat16], "gemm_fp32": rates[torch.float32]}
            dtype_name = "bf16" if ns_dtype == torch.bfloat16 else "fp32"
            executed = executed_floor_ms(optimizer, shapes, rate_names, dtype_name)
        results[label] = (ns_dtype, ms, worst_update_error(params, initial, references), executed)

    report = Report()
    emit = report.emit

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    emit(f"# float32 weights, {len(shapes)} matrices ({args.layers} Llama-3-8B layers, scale 1/{args.scale}), "
         f"1 x {name}, torch {torch.__version__}")
    emit(f"GEMM rates measured: bf16 {rates[torch.bfloat16] / 1e12:.1f} TFLOP/s, float32 "
         f"{rates[torch.float32] / 1e12:.1f} TFLOP/s; useful Newton-Schulz flops {useful / 1e12:.2f} TFLOP")
    emit("")
    baseline = results.get("torch.optim.Muon")
    emit("| optimizer | iteration dtype | step (ms) | x torch.optim.Muon | plain-iteration floor (ms) | "
         "time / it | executed floor (ms) | time / it | worst update error vs float64 |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for label, (ns_dtype, ms, error, executed) in results.items():
        plain = useful / rates[ns_dtype] * 1e3
        ratio = f"{baseline[1] / ms:.2f}" if baseline else "-"
        own = f"{executed:.2f} | {ms / executed:.2f}" if executed else "- | -"
        emit(f"| {label} | {str(ns_dtype)[6:]} | {ms:.2f} | {ratio} | {plain:.2f} | {ms / plain:.2f} | {own} | "
             f"{error:.2e} |")
    report.save(args.out, "bench_param_dtypes.md")


if __name__ == "__main__":
    main()
