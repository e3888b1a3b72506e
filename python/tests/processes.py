"""Runs a test function on several CPU processes over gloo, and cuts whole matrices into the
shards a rank holds."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(function, world, *args):
    port = free_port()
    mp.spawn(_entry, args=(world, port, function, args), nprocs=world, join=True)


def _entry(rank, world, port, function, args):
    import faulthandler
    faulthandler.enable()  # a native abort prints where Python was
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        function(rank, world, *args)
    except BaseException:
        # Report this rank's failure before the others notice the process group go away.
        import traceback
        traceback.print_exc()
        raise
    dist.destroy_process_group()


def split(total, weights):
    """Shard sizes proportional to weights (zeros allowed), summing to total."""
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


def shard_of(whole, dim, sizes, rank):
    if dim == -1:
        return whole.clone()
    start = sum(sizes[:rank])
    return whole.narrow(dim, start, sizes[rank]).clone()
