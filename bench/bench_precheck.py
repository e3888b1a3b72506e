"""What the gradient pass before a step over several process groups costs on one GPU: the
front end's _any_nonfinite (one 1-norm per gradient, torch._foreach_norm, stacked, isfinite)
on GPT-2 small's 48 matrices in float32 and on 8 Llama-3-8B layers at TP 2 (one rank's
shards) in bf16; random gradients, CUDA events around the call, 5 warm-ups, median of 30,
against the HBM read floor (bytes / 4.8 TB/s on an H200, 3.35 TB/s otherwise, as on the H100
80GB HBM3). Then a NaN put in the last gradient must be found.

    python3 bench/bench_precheck.py
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from shardmuon.torch import _any_nonfinite  # noqa: E402

dev = torch.device("cuda")
name = torch.cuda.get_device_name()
bw = 4.8e12 if "H200" in name else 3.35e12
gpt2 = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12
llama = [(2048, 4096), (512, 4096), (512, 4096), (4096, 2048), (7168, 4096), (7168, 4096), (4096, 7168)] * 8
for label, shapes, dtype in (("gpt2-small fp32", gpt2, torch.float32),
                             ("llama3-8b 8 layers TP2 bf16", llama, torch.bfloat16)):
    grads = [torch.randn(s, device=dev, dtype=dtype) for s in shapes]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    times = []
    for i in range(35):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        flag = _any_nonfinite(grads, dev)
        b.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b))
    assert flag.item() == 0.0
    grads[-1][3, 5] = float("nan")
    assert _any_nonfinite(grads, dev).item() == 1.0
    med = statistics.median(times)
    floor = nbytes / bw * 1e3
    print(f"precheck {label}: {len(grads)} tensors, {nbytes / 1e6:.0f} MB, median {med:.3f} ms "
          f"(min {min(times):.3f}), floor {floor:.3f} ms, ratio {med / floor:.2f} [{name}]")
