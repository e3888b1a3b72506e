"""What the gradient pass before a step over several process groups costs on one GPU: the
front end's _any_nonfinite (one 1-norm per gradient by torch._foreach_norm, in float32 for
float16 and bfloat16, one stack and isfinite per dtype) on GPT-2 small's 48 matrices in
float32 and on 8 Llama-3-8B layers at TP 2 (one rank's shards) in bf16; random gradients,
CUDA events around the call, 5 warm-ups, median of 30, the two forms timed in alternation,
each alone (an idle GPU: the host's launches count) and queued behind a GPU sleep (the
kernels' time only, as behind a backward pass), against the HBM read floor (bytes / 4.8 TB/s
on an H200, 3.35 TB/s otherwise, as on the H100 80GB HBM3). The baseline is the form before
the forty-first session (norms in the tensors' dtype, converted to float32 one by one, which
let a float16 norm overflow). Then a NaN put in the last gradient must be found by both.

    python3 bench/bench_precheck.py
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from shardmuon.torch import _any_nonfinite  # noqa: E402


def any_nonfinite_before(tensors, device):
    """The baseline: _any_nonfinite as of e481c78."""
    norms = torch._foreach_norm(tensors, 1)
    norms = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    return (~torch.isfinite(norms)).any().to(torch.float32)


def time_ms(function, grads, dev, queued):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(4_000_000)  # about 2 ms: the host launches everything meanwhile
    a.record()
    function(grads, dev)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


dev = torch.device("cuda")
name = torch.cuda.get_device_name()
bw = 4.8e12 if "H200" in name else 3.35e12
gpt2 = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12
llama = [(2048, 4096), (512, 4096), (512, 4096), (4096, 2048), (7168, 4096), (7168, 4096), (4096, 7168)] * 8
forms = {"now": _any_nonfinite, "before": any_nonfinite_before}
for label, shapes, dtype in (("gpt2-small fp32", gpt2, torch.float32),
                             ("llama3-8b 8 layers TP2 bf16", llama, torch.bfloat16)):
    grads = [torch.randn(s, device=dev, dtype=dtype) for s in shapes]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    times = {(form, queued): [] for form in forms for queued in (False, True)}
    for i in range(35):
        for (form, queued), samples in times.items():
            elapsed = time_ms(forms[form], grads, dev, queued)
            if i >= 5:
                samples.append(elapsed)
    grads[-1][3, 5] = float("nan")
    for form, function in forms.items():
        assert function(grads[:-1], dev).item() == 0.0 and function(grads, dev).item() == 1.0, form
    floor = nbytes / bw * 1e3
    print(f"precheck {label}: {len(grads)} tensors, {nbytes / 1e6:.0f} MB, floor {floor:.3f} ms [{name}]")
    for queued in (False, True):
        now, before = (statistics.median(times[(form, queued)]) for form in ("now", "before"))
        lows = {form: min(times[(form, queued)]) for form in forms}
        print(f"  {'queued' if queued else 'alone '}: now median {now:.3f} ms (min {lows['now']:.3f}, "
              f"{now / floor:.2f}x floor); before median {before:.3f} ms (min {lows['before']:.3f}, "
              f"{before / floor:.2f}x floor); now / before {now / before:.2f}")
