"""What MuonWithAdamW's non-finite check costs a training loop on one GPU: iterations
(forward under bf16 autocast, backward, step) of a GPT-2-small-shaped model (examples/
train_lm.py's CharTransformer: vocabulary 50304, width 768, 12 layers, 12 heads, 256 tokens,
batch 8) under nonfinite="skip" (the AdamW gradients' 1-norms into the Muon step's flag, whose
verdict the fused AdamW reads on the GPU) against nonfinite="proceed" (no check), two models of
the same initial weights, rounds interleaved. With --loss-scaler: float16 autocast and
torch.amp.GradScaler, the scaler's protocol (the step unscales and skips on the GPU) against
its ordinary path (the optimizer's _step_supports_amp_scaling off: unscale_, found_inf read on
the host, step() called or not).

    python3 bench/bench_nonfinite_check.py [--rounds 3] [--iterations 30] [--loss-scaler]

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


def model_and_optimizer(policy: str, device: torch.device, protocol: bool = True):
    model = CharTransformer(VOCAB, DIM, LAYERS, HEADS, SEQ, 0).to(device)
    groups = st.muon_param_groups(model, muon_lr=3e-3, adamw_lr=3e-3, adamw_weight_decay=0.01)
    optimizer = st.MuonWithAdamW(groups, weight_decay=0.01, scale_mode="spectral", extra_scale_factor=0.2,
                                 nonfinite=policy)
    optimizer._step_supports_amp_scaling = protocol
    return model, optimizer


def iterations(model, optimizer, count: int, batches, scaler=None):
    """(wall ms per iteration, median GPU ms of the step)."""
    events = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(count):
        with torch.autocast("cuda", dtype=torch.bfloat16 if scaler is None else torch.float16):
            logits = model(batches[i % len(batches)])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batches[(i + 1) % len(batches)].flatten())
        optimizer.zero_grad(set_to_none=True)
        (loss if scaler is None else scaler.scale(loss)).backward()
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        after.record()
        events.append((before, after))
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / count * 1e3
    return wall, statistics.median(a.elapsed_time(b) for a, b in events)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--loss-scaler", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), device=device) for _ in range(4)]
    if args.loss_scaler:  # each run its own scaler (step() and update() keep per-optimizer state)
        runs = {name: (*model_and_optimizer("skip", device, name == "protocol"), torch.amp.GradScaler("cuda"))
                for name in ("protocol", "ordinary")}
    else:
        runs = {policy: (*model_and_optimizer(policy, device), None) for policy in ("skip", "proceed")}
    names = list(runs)
    for model, optimizer, scaler in runs.values():
        iterations(model, optimizer, 5, batches, scaler)  # warm-up
    results = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            model, optimizer, scaler = runs[name]
            results[name].append(iterations(model, optimizer, args.iterations, batches, scaler))
    fused = all(g["fused"] for g in runs[names[0]][1]._adam.param_groups)
    print(f"{torch.cuda.get_device_name(device)}; AdamW fused: {fused}; {args.iterations} iterations a round")
    for name, rows in results.items():
        print(f"{name:8s} iteration (ms): {', '.join(f'{wall:.2f}' for wall, _ in rows)}; "
              f"step on the GPU (ms): {', '.join(f'{step:.2f}' for _, step in rows)}")
    for name, (_, optimizer, scaler) in runs.items():
        scale = "" if scaler is None else f", scale {scaler.get_scale():g}"
        print(f"{name}: skipped {optimizer.nonfinite_counts()}{scale}")


if __name__ == "__main__":
    main()
