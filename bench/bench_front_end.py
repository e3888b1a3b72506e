"""The host side of a Muon step: how long shardmuon.torch.Muon's Python takes before the
library call, for plain tensors and for DTensor parameters (FSDP2-style Shard(0), and
Replicate) on a device mesh of one rank, GPT-2-class bf16 weights on one GPU; and for the
weights of nn.Linear layers sharded by FSDP2 itself (fully_shard), their gradients from a
backward through FSDP2.

    torchrun --nproc_per_node=1 bench/bench_front_end.py [--model gpt2] [--repeats 30]
    torchrun --nproc_per_node=1 bench/bench_front_end.py --python OTHER/python   # another front end

Per mode, after a first step and three warm-ups, the median over --repeats of:
  - "front end": step() with the library call replaced by nothing, the host's clock around
    it (with the GPU idle): the Python of the step alone;
  - "step host": the whole step() on the host's clock (front end and the library's launches);
  - "eager step": from the call until the GPU has finished it (host clock, synchronized
    before and after): what a training loop waits for when the step is its bottleneck.
--python puts another copy of the package first on the path (an older front end, say, with
the same library), so that two front ends can be run one after the other on one machine.
Each line also says in how many of the timed steps the front end reused the last step's
arguments instead of building and checking them all again (shardmuon.torch._StepCache).
--profile prints cProfile's top functions of five front-end steps per mode.
Shapes (nn.Linear's out x in) per layer: 3d x d, d x d, 4d x d, d x 4d; gpt2 has d = 768 and
12 layers, gpt2-medium 1024 and 24, gpt2-xl 1600 and 48 (as bench_small_model.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

MODELS = {"gpt2": (768, 12), "gpt2-medium": (1024, 24), "gpt2-xl": (1600, 48)}
MODES = ("plain", "shard0", "replicate", "fsdp2")


def parameters(mode, wholes, grads, mesh, device):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if mode == "fsdp2":
        return fsdp2_parameters(wholes, mesh, device)
    params = []
    for whole, grad in zip(wholes, grads):
        if mode == "plain":
            param = torch.nn.Parameter(whole.to(device))
            param.grad = grad.to(device)
        else:
            placements = [Shard(0)] if mode == "shard0" else [Replicate()]
            param = torch.nn.Parameter(distribute_tensor(whole.to(device), mesh, placements))
            param.grad = distribute_tensor(grad.to(device), mesh, placements)
        params.append(param)
    return params


def fsdp2_parameters(wholes, mesh, device):
    """Each matrix the weight of an nn.Linear sharded by fully_shard (a Shard(0) DTensor), its
    gradient from a backward through FSDP2 (reduce-scattered into a new DTensor)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard

    layers = []
    for whole in wholes:
        layer = torch.nn.Linear(whole.shape[1], whole.shape[0], bias=False, device=device, dtype=whole.dtype)
        with torch.no_grad():
            layer.weight.copy_(whole)
        fully_shard(layer, mesh=mesh)
        inputs = torch.ones(4, whole.shape[1], device=device, dtype=whole.dtype)
        layer(inputs).float().square().mean().backward()
        layers.append(layer)
    return [layer.weight for layer in layers]


def median_ms(optimizer, repeats):
    """(host, until the GPU is done) medians of step(), in ms."""
    host, done = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        done.append(time.perf_counter() - start)
    return statistics.median(host) * 1e3, statistics.median(done) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=sorted(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--python", help="a directory holding another shardmuon package, first on the path")
    parser.add_argument("--label", default="", help="printed before every line (which front end)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, args.python or os.path.join(here, "..", "python"))
    import shardmuon.torch as st
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mesh = init_device_mesh("cuda", (1,))
    width, layers = MODELS[args.model]
    shapes = [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers
    generator = torch.Generator().manual_seed(0)
    wholes = [(0.02 * torch.randn(*shape, generator=generator)).bfloat16() for shape in shapes]
    grads = [torch.randn(*shape, generator=generator).bfloat16() for shape in shapes]
    print(f"{args.label}{args.model}: {len(shapes)} bf16 matrices, torch {torch.__version__}, "
          f"front end from {os.path.dirname(st.__file__)}", flush=True)
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
        optimizer = st.Muon(parameters(mode, wholes, grads, mesh, device), lr=0.02, weight_decay=0.01)
        for _ in range(4):
            optimizer.step()
        full_checks = []
        collect = optimizer._collect
        optimizer._collect = lambda: full_checks.append(True) or collect()
        host, done = median_ms(optimizer, args.repeats)
        optimizer._call_step = lambda *arguments: None  # the front end alone from here
        optimizer.step()
        front_end, _ = median_ms(optimizer, args.repeats)
        print(f"{args.label}{args.model} {mode:9s} front end {front_end:7.3f} ms "
              f"({front_end * 1e3 / len(shapes):5.1f} us a parameter), step host {host:7.3f} ms, "
              f"eager step {done:7.3f} ms, reused {args.repeats - len(full_checks)} of {args.repeats}",
              flush=True)
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(5):
                optimizer.step()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
            print(text.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
