"""Library handles for PyTorch: one context per device, one communicator per process group.

CUDA tensors use the CUDA backend over the NCCL communicator borrowed from the group's
ProcessGroupNCCL; CPU tensors use the CPU backend, over a one-rank communicator or, for a
group of several ranks, over the group's own collectives (gloo) through the library's
callback communicator.
"""

from __future__ import annotations

import ctypes
import sys
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from . import _capi as c


class Context:
    def __init__(self, device: torch.device, ns_batch_bytes: Optional[int] = None,
                 nonfinite_policy: Optional[int] = None):
        self.device = device
        handle = ctypes.c_void_p()
        if device.type == "cuda":
            c.check(c.lib.shardmuon_context_create(c.BACKEND_CUDA, device.index, ctypes.byref(handle)))
        else:
            c.check(c.lib.shardmuon_context_create(c.BACKEND_CPU, 0, ctypes.byref(handle)))
        self.handle = handle
        if ns_batch_bytes is not None:
            c.check(c.lib.shardmuon_context_set_ns_batch_bytes(handle, ns_batch_bytes))
        self.nonfinite_policy: Optional[int] = None  # the library's default until set
        if nonfinite_policy is not None:
            self.set_nonfinite_policy(nonfinite_policy)
        self.step_flag: Optional[torch.Tensor] = None  # see use_step_flag

    def set_nonfinite_policy(self, policy: int) -> None:
        """shardmuon_context_set_nonfinite_policy, where it changes the policy."""
        if policy != self.nonfinite_policy:
            c.check(c.lib.shardmuon_context_set_nonfinite_policy(self.handle, policy))
            self.nonfinite_policy = policy

    def use_step_flag(self, flag: torch.Tensor) -> None:
        """Shares a one-element float32 tensor on this context's device with its steps
        (shardmuon_context_set_step_flag): they read it as one more gradient and write their
        verdict there. Kept here, so that it lives as long as the library holds its address."""
        c.check(c.lib.shardmuon_context_set_step_flag(self.handle, ctypes.c_void_p(flag.data_ptr())))
        self.step_flag = flag

    def nonfinite_counts(self):
        """(steps, parameters) skipped for non-finite values so far; waits for the device."""
        steps, params = ctypes.c_int64(), ctypes.c_int64()
        c.check(c.lib.shardmuon_context_nonfinite_counts(self.handle, ctypes.byref(steps), ctypes.byref(params)))
        return steps.value, params.value

    def __del__(self):
        if getattr(self, "handle", None):
            c.lib.shardmuon_context_destroy(self.handle)
            self.handle = None


class _Local:
    """The "group" of a matrix this rank holds whole and orthogonalizes on its own (an expert
    parallelism's experts, or a parameter replicated over a mesh of several dimensions)."""

    def __repr__(self):
        return "LOCAL"


LOCAL = _Local()


def group_size(group) -> int:
    if group is LOCAL or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is LOCAL or not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def backend_name(group) -> str:
    return str(dist.get_backend(group)).lower()


def normalize_group(group):
    """None for the world group: torch's own alias for it. Holding the world ProcessGroup
    object itself would keep it alive after destroy_process_group(), to be destroyed during
    the interpreter's exit, which can abort the process (seen with gloo)."""
    if group is None:
        return None
    if dist.is_available() and dist.is_initialized() and group is dist.group.WORLD:
        return None
    return group


def checked_group(group, where: str):
    """normalize_group of a process group the user passed: anything but None or a
    torch.distributed ProcessGroup is refused here, naming it (it would fail inside the first
    step's collectives otherwise)."""
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{where}: process_group must be None (the default group) or a "
                        f"torch.distributed ProcessGroup, got {group!r}")
    return normalize_group(group)


def _global_rank(group, rank: int) -> int:
    """The world rank of a group's rank (point-to-point calls take world ranks)."""
    if group is None or group is dist.group.WORLD:
        return rank
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(group, rank)
    return dist.distributed_c10d._get_global_rank(group, rank)


def _host_tensor(address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over host memory the library owns (no copy)."""
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buffer = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=dtype)


class _GlooCallbacks:
    """The library's collectives over a torch.distributed group of CPU processes."""

    def __init__(self, group):
        self.group = normalize_group(group)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = [_global_rank(group, r) for r in range(self.size)]
        self.error = None
        # The C function pointers must live as long as the communicator.
        self.functions = (
            c.ALL_REDUCE_SUM(self._guard(self.all_reduce_sum)),
            c.ALL_GATHER(self._guard(self.all_gather)),
            c.ALL_TO_ALL(self._guard(self.all_to_all)),
            c.AGREE_MAX(self._guard(self.agree_max)),
        )

    def _guard(self, function):
        def call(*args):
            try:
                function(*args[1:])  # drop user_data
                return 0
            except BaseException as error:  # reported by the library as a failed callback
                self.error = error
                traceback.print_exc(file=sys.stderr)
                return 1

        return call

    def all_reduce_sum(self, buffer, count, dtype, stream):
        torch_dtype, element = (torch.float64, 8) if dtype == c.FLOAT64 else (torch.float32, 4)
        tensor = _host_tensor(buffer, count * element, torch_dtype)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_gather(self, buffer, block_bytes, stream):
        whole = _host_tensor(buffer, block_bytes * self.size, torch.uint8)
        blocks = list(whole.split(block_bytes))
        own = blocks[self.rank].clone()
        dist.all_gather(blocks, own, group=self.group)

    def all_to_all(self, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets, stream):
        requests = []
        for peer in range(self.size):
            out_bytes, in_bytes = send_bytes[peer], recv_bytes[peer]
            out = _host_tensor(send + send_offsets[peer], out_bytes, torch.uint8) if out_bytes else None
            into = _host_tensor(recv + recv_offsets[peer], in_bytes, torch.uint8) if in_bytes else None
            if peer == self.rank:
                if in_bytes:
                    into.copy_(out)
                continue
            if out_bytes:
                requests.append(dist.isend(out, self.global_ranks[peer], group=self.group))
            if in_bytes:
                requests.append(dist.irecv(into, self.global_ranks[peer], group=self.group))
        for request in requests:
            request.wait()

    def agree_max(self, values, count):
        tensor = torch.tensor([values[i] for i in range(count)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        for i in range(count):
            values[i] = int(tensor[i])


class Communicator:
    def __init__(self, group, device: torch.device):
        self.group = group
        self.callbacks = None
        handle = ctypes.c_void_p()
        size = group_size(group)
        if size == 1:
            c.check(c.lib.shardmuon_comm_create_self(ctypes.byref(handle)))
        elif device.type == "cuda":
            name = backend_name(group)  # "nccl", or a per-device list like "cpu:gloo,cuda:nccl"
            if "nccl" not in name:
                raise ValueError(
                    f"shardmuon: CUDA parameters need an NCCL process_group, got a {name!r} group")
            pointer = _nccl_comm_pointer(group, device)
            c.check(c.lib.shardmuon_comm_create_nccl(ctypes.c_void_p(pointer), ctypes.byref(handle)))
        else:
            name = backend_name(group)
            if "gloo" not in name:
                raise ValueError(
                    f"shardmuon: CPU parameters need a gloo process_group, got a {name!r} group")
            self.callbacks = _GlooCallbacks(group)
            table = c.CommCallbacks(None, self.callbacks.rank, self.callbacks.size, *self.callbacks.functions)
            c.check(c.lib.shardmuon_comm_create_callbacks(ctypes.byref(table), c.BACKEND_CPU, ctypes.byref(handle)))
        self.handle = handle

    def clear_callback_error(self):
        """Forgets a callback's failure (after a call made only to fail, see Muon._calls)."""
        if self.callbacks is not None:
            self.callbacks.error = None

    def raise_callback_error(self):
        """A collective that failed inside a callback, with its own exception."""
        if self.callbacks is not None and self.callbacks.error is not None:
            error, self.callbacks.error = self.callbacks.error, None
            raise RuntimeError(f"shardmuon: a collective of the process group failed: {error!r}") from error

    def __del__(self):
        if getattr(self, "handle", None):
            c.lib.shardmuon_comm_destroy(self.handle)
            self.handle = None


class Runtimes:
    """The handles of an optimizer or NewtonSchulz, made on first use: one context (and its
    workspace) per device, one communicator per device and process group."""

    def __init__(self, ns_batch_bytes: Optional[int] = None, nonfinite_policy: Optional[int] = None):
        # The contexts' settings (None: the library's defaults).
        self._ns_batch_bytes, self._nonfinite_policy = ns_batch_bytes, nonfinite_policy
        self._contexts = {}
        self._comms = {}

    def context(self, device: torch.device) -> Context:
        if device not in self._contexts:
            self._contexts[device] = Context(device, self._ns_batch_bytes, self._nonfinite_policy)
        return self._contexts[device]

    def contexts(self):
        return list(self._contexts.values())

    def get(self, device: torch.device, group):
        context = self.context(device)
        if (device, group) not in self._comms:
            self._comms[(device, group)] = Communicator(group, device)
        return context, self._comms[(device, group)]


def _nccl_comm_pointer(group, device: torch.device) -> int:
    """The ncclComm_t of a ProcessGroupNCCL (PyTorch creates it lazily: a first collective
    on this device makes sure it exists)."""
    if group is None:  # the world group, which normalize_group() holds as None
        group = dist.distributed_c10d._get_default_group()
    backend = group._get_backend(device) if hasattr(group, "_get_backend") else None
    if backend is None or not hasattr(backend, "_comm_ptr"):
        raise RuntimeError(
            "shardmuon: this PyTorch's ProcessGroupNCCL does not expose _comm_ptr(); "
            "PyTorch 2.2 or later is needed for CUDA tensors")
    pointer = 0
    try:
        pointer = int(backend._comm_ptr())
    except RuntimeError:
        pointer = 0
    if pointer == 0:
        warm = torch.zeros(1, device=device)
        dist.all_reduce(warm, group=group)
        torch.cuda.synchronize(device)
        pointer = int(backend._comm_ptr())
    return pointer
