"""What MuonWithAdamW's non-finite check costs a training loop on one GPU: iterations
(forward under bf16 autocast, backward, step) of a GPT-2-small-shaped model (examples/
train_lm.py's CharTransformer: vocabulary 50304, width 768, 12 layers, 12 heads, 256 tokens,
batch 8) under nonfinite="skip" (the AdamW gradients' 1-norms into the Muon step's flag, whose
verdict the fused AdamW reads on the GPU) against nonfinite="proceed" (no check), two models of
the same initial weights, rounds interleaved.

    python3 bench/bench_nonfinite_check.py [--rounds 3] [--iterations 30]

Prints per round the wall time of an iteration (the mean over the round, after a
synchronization at each end: what a training loop sees, the host's launches included) and the
median of the step's own time on the GPU (CUDA events around step()).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

root = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(root / "examples"), str(root / "python")]
import shardmuon.torch as st  # noqa: E402
from train_lm import CharTransformer  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 50304, 768, 12, 12, 256, 8


def model_and_optimizer(policy: str, device: torch.device):
    model = CharTransformer(VOCAB, DIM, LAYERS, HEADS, SEQ, 0).to(device)
    groups = st.muon_param_groups(model, muon_lr=3e-3, adamw_lr=3e-3, adamw_weight_decay=0.01)
    optimizer = st.MuonWithAdamW(groups, weight_decay=0.01, scale_mode="spectral", extra_scale_factor=0.2,
                                 nonfinite=policy)
    return model, optimizer


def iterations(model, optimizer, count: int, batches):
    """(wall ms per iteration, median GPU ms of the step)."""
    events = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(count):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batches[i % len(batches)])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batches[(i + 1) % len(batches)].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        optimizer.step()
        after.record()
        events.append((before, after))
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / count * 1e3
    return wall, statistics.median(a.elapsed_time(b) for a, b in events)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), device=device) for _ in range(4)]
    runs = {policy: model_and_optimizer(policy, device) for policy in ("skip", "proceed")}
    for run in runs.values():
        iterations(*run, 5, batches)  # warm-up
    results = {policy: [] for policy in runs}
    for round_index in range(args.rounds):
        order = ("skip", "proceed") if round_index % 2 == 0 else ("proceed", "skip")
        for policy in order:
            results[policy].append(iterations(*runs[policy], args.iterations, batches))
    fused = all(g["fused"] for g in runs["skip"][1]._adam.param_groups)
    print(f"{torch.cuda.get_device_name(device)}; AdamW fused: {fused}; {args.iterations} iterations a round")
    for policy, rows in results.items():
        print(f"{policy:8s} iteration (ms): {', '.join(f'{wall:.2f}' for wall, _ in rows)}; "
              f"step on the GPU (ms): {', '.join(f'{step:.2f}' for _, step in rows)}")
    print("skipped:", runs["skip"][1].nonfinite_counts())


if __name__ == "__main__":
    main()
