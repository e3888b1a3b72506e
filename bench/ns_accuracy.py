"""Accuracy of the standard Newton-Schulz iteration against Gram Newton-Schulz ((e)) and the
Gram applied twice ((c)) on matrices with hard spectra, each against a float64 run of the same
iteration (the same schedule's coefficients on the float64 matrix). On one rank a request for
(c) runs the whole matrix with its iteration: the same products as on a group, but the Gram
is not a sum of partial ones. Runs on whatever device is given (CPU by default, where bf16 is
the CPU backend's emulation: bf16 storage, float32 arithmetic).

    SHARDMUON_LIBRARY=build/libshardmuon.so python3 bench/ns_accuracy.py [--device cuda] \
        [--schedules quintic:5,polar_express:8] [--algorithms gram_newton_schulz,gram_applied_twice]

Prints one row per spectrum, dtype and schedule: the relative Frobenius error of the standard
iteration ("duplicated" names it on one rank) and of each algorithm, with its ratio to it.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from shardmuon.torch import NewtonSchulz  # noqa: E402


def spectra(rows, cols, generator):
    """Matrices of rows x cols, each with a spectrum that stresses an iteration."""
    def gaussian():
        return torch.randn(rows, cols, generator=generator, dtype=torch.float64)

    def with_singular_values(values):
        u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=generator, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(cols, rows, generator=generator, dtype=torch.float64))
        return u @ torch.diag(values) @ v.T

    k = min(rows, cols)
    rank8 = torch.zeros(k, dtype=torch.float64)
    rank8[:8] = 1.0
    return {
        "gaussian": gaussian(),
        "rank 8 + 1e-3 noise": with_singular_values(rank8) + 1e-3 * gaussian() / (rows * cols) ** 0.5,
        "one value 1000x": gaussian() + 1000.0 * torch.outer(
            torch.randn(rows, generator=generator, dtype=torch.float64),
            torch.randn(cols, generator=generator, dtype=torch.float64)) / (rows * cols) ** 0.25,
        "geometric 0.97^i": with_singular_values(0.97 ** torch.arange(k, dtype=torch.float64)),
        "condition 1e4": with_singular_values(torch.logspace(0, -4, k, dtype=torch.float64)),
    }


def float64_iteration(x, coefficients, eps):
    x = x / x.norm().clamp(min=eps)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="256x1024")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schedules", default="quintic:5,polar_express:8")
    parser.add_argument("--algorithms", default="gram_newton_schulz,gram_applied_twice")
    args = parser.parse_args()
    rows, cols = (int(x) for x in args.shape.split("x"))
    generator = torch.Generator().manual_seed(args.seed)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    schedules = [(name, int(steps)) for name, steps in (item.split(":") for item in args.schedules.split(","))]
    algorithms = args.algorithms.split(",")
    print("| spectrum | dtype | schedule | standard | " + " | ".join(f"{a} | / standard" for a in algorithms) + " |")
    print("|---|---|---|---|" + "---|---|" * len(algorithms))
    for name, matrix in spectra(rows, cols, generator).items():
        for label, dtype in dtypes.items():
            for schedule, steps in schedules:
                errors = []
                for algorithm in ["duplicated"] + algorithms:
                    ns = NewtonSchulz(None, ns_steps=steps, coefficient_type=schedule, algorithm=algorithm)
                    exact = float64_iteration(matrix, ns.coefficients(), 1e-7)
                    shard = matrix.to(dtype).to(args.device).contiguous()
                    ns(shard, (rows, cols))
                    result = shard.to("cpu", torch.float64)
                    errors.append(((result - exact).norm() / exact.norm()).item())
                cells = " | ".join(f"{e:.2e} | {e / errors[0]:.2f}" for e in errors[1:])
                print(f"| {name} | {label} | {schedule} {steps} | {errors[0]:.2e} | {cells} |")


if __name__ == "__main__":
    main()
