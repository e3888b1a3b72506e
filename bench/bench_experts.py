"""Mixture-of-experts optimizer step on one GPU: shardmuon.torch.Muon over 3D (experts x rows x
cols) parameters, whose experts run as strided batches, against the same step with every
expert on its own and against two PyTorch loops, in the same run, on the same inputs, with
every result checked against float64.

    python3 bench/bench_experts.py [--repeats 5] [--out DIR]
    python3 bench/bench_experts.py --device cpu --scale 16   # a smoke test, no GPU

Parameters: one MoE layer's expert weights of two models, fused gate+up and down,
  Qwen3-30B-A3B: 128 experts, 1536 x 2048 and 2048 x 768;
  DeepSeek-V2-Lite: 64 experts, 2816 x 2048 and 2048 x 1408;
bf16 on the GPU. Rows:
  - shardmuon batched: Muon with algorithm auto; each 3D parameter's experts are orthogonalized
    as strided batches (NsProblem::batch);
  - shardmuon one by one: the same with SHARDMUON_MAX_NS_BATCH=1;
  - torch loop: per expert, momentum, the Newton-Schulz in PyTorch (A = X X^T,
    B = b A + c A A, X = a X + B X), the update (what torch.optim.Muon does per 2D parameter);
  - torch batched: the same iteration on the 3D tensors with batched matmuls (baddbmm).
Times: one optimizer step, warm-ups, median over repeats (CUDA events). The floor is the
useful Newton-Schulz flops, K (4 s^2 L + 2 s^3) per expert, over the GEMM rate measured at
the start. Accuracy: after one step from the same state, every parameter against a float64
step (relative Frobenius error, the worst over parameters).
"""

from __future__ import annotations

import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))
sys.path.insert(0, here)
import shardmuon.torch as st  # noqa: E402
from bench_newton_schulz import torch_newton_schulz  # noqa: E402
from bench_step import (LR, MOMENTUM, STEPS, WEIGHT_DECAY, Clock, Report, scale, standard_arguments,  # noqa: E402
                        state_resetter)

EXPERTS = [("qwen3-30b-a3b.gate_up", 128, 1536, 2048), ("qwen3-30b-a3b.down", 128, 2048, 768),
           ("deepseek-v2-lite.gate_up", 64, 2816, 2048), ("deepseek-v2-lite.down", 64, 2048, 1408)]
EPS = 1e-7


def batched_newton_schulz(x, coefficients):
    """The torch iteration on a stack of matrices (experts x rows x cols), batched matmuls."""
    transposed = x.size(1) > x.size(2)
    if transposed:
        x = x.mT
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=EPS)
    for a, b, c in coefficients:
        gram = x @ x.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if transposed else x


def torch_step(params, grads, momenta, coefficients, batched):
    for p, g, m in zip(params, grads, momenta):
        m.lerp_(g, 1 - MOMENTUM)
        update = g.lerp(m, MOMENTUM)
        rows, cols = p.shape[1], p.shape[2]
        if batched:
            result = batched_newton_schulz(update, coefficients)
        else:
            result = torch.stack([torch_newton_schulz(u, coefficients, u.dtype) for u in update])
        p.mul_(1 - LR * WEIGHT_DECAY).add_(result.to(p.dtype), alpha=-LR * scale(rows, cols))


def main():
    args = standard_arguments(__doc__).parse_args()

    if args.device == "cuda":
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = False
    else:
        device, dtype = torch.device("cpu"), torch.float32
    clock = Clock(device, 1, args.warmups, args.repeats)
    coefficients = st.NewtonSchulz(ns_steps=STEPS).coefficients()

    generator = torch.Generator(device=device).manual_seed(4321)
    shapes, initial = [], []
    for name, experts, rows, cols in EXPERTS:
        experts, rows, cols = max(2, experts // args.scale), rows // args.scale, cols // args.scale
        shapes.append((name, experts, rows, cols))
        w = 0.02 * torch.randn(experts, rows, cols, device=device, generator=generator)
        g = torch.randn(experts, rows, cols, device=device, generator=generator)
        m = 0.1 * torch.randn(experts, rows, cols, device=device, generator=generator)
        initial.append((w.to(dtype), g.to(dtype), m.to(dtype)))
    useful = sum(STEPS * e * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for _, e, r, c in shapes)
    a = torch.randn(8192 // args.scale, 8192 // args.scale, device=device).to(dtype)
    gemm_ms = clock.median_ms(lambda: None, lambda: a @ a)
    gemm_rate = 2 * a.shape[0] ** 3 / (gemm_ms * 1e-3)
    floor_ms = useful / gemm_rate * 1e3

    references = []
    for w, g, m in initial:
        w, g, m = w.double(), g.double(), m.double()
        m = m.lerp(g, 1 - MOMENTUM)
        update = batched_newton_schulz(g.lerp(m, MOMENTUM), coefficients)
        references.append(w * (1 - LR * WEIGHT_DECAY) - LR * scale(w.shape[1], w.shape[2]) * update)

    def worst_error(params):
        return max(float((p.detach().double() - r).norm() / r.norm()) for p, r in zip(params, references))

    report = Report()
    emit = report.emit

    matrices = sum(e for _, e, _, _ in shapes)
    emit(f"# MoE step benchmark: {len(shapes)} parameters, {matrices} experts, 1 x "
         f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, {dtype}, scale 1/{args.scale}")
    emit("experts: " + ", ".join(f"{name} {e} x {r} x {c}" for name, e, r, c in shapes))
    emit(f"GEMM rate measured: {gemm_rate / 1e12:.1f} TFLOP/s; useful Newton-Schulz flops "
         f"{useful / 1e12:.2f} TFLOP; floor {floor_ms:.2f} ms")
    emit("")
    emit("| method | step (ms) | x torch loop | x torch batched | time / floor | worst error vs float64 |")
    emit("|---|---|---|---|---|---|")

    params = [torch.nn.Parameter(w.clone()) for w, _, _ in initial]
    reset = state_resetter(params, initial)

    results = {}
    for label, batched in (("torch loop", False), ("torch batched", True)):
        momenta = [m.clone() for _, _, m in initial]

        def prepare():
            reset()
            for buffer, (_, _, m) in zip(momenta, initial):
                buffer.copy_(m)

        def run(batched=batched, momenta=momenta):
            with torch.no_grad():
                torch_step(params, [g for _, g, _ in initial], momenta, coefficients, batched)

        ms = clock.median_ms(prepare, run)
        prepare()
        run()
        results[label] = (ms, worst_error(params))

    optimizer = st.Muon(params, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY,
                        num_ns_steps=STEPS)
    for label, cap in (("shardmuon batched", None), ("shardmuon one by one", "1")):
        if cap is None:
            os.environ.pop("SHARDMUON_MAX_NS_BATCH", None)
        else:
            os.environ["SHARDMUON_MAX_NS_BATCH"] = cap
        ms = clock.median_ms(lambda: reset(optimizer), optimizer.step)
        reset(optimizer)
        optimizer.step()
        results[label] = (ms, worst_error(params))
    os.environ.pop("SHARDMUON_MAX_NS_BATCH", None)

    loop_ms, batched_ms = results["torch loop"][0], results["torch batched"][0]
    for label in ("shardmuon batched", "shardmuon one by one", "torch loop", "torch batched"):
        ms, error = results[label]
        emit(f"| {label} | {ms:.2f} | {loop_ms / ms:.2f} | {batched_ms / ms:.2f} | {ms / floor_ms:.2f} | "
             f"{error:.2e} |")
    report.save(args.out, "bench_experts.md")


if __name__ == "__main__":
    main()
