"""The PyTorch front end: ``Muon``, a ``torch.optim.Optimizer`` whose step runs shardmuon's
distributed Muon on tensor-parallel weight shards, ``MuonWithAdamW``, which trains the
non-matrix parameters with AdamW beside it, and ``TorchMuon``, ``Muon`` under
torch.optim.Muon's arguments for code written for that.

Arguments and defaults follow TransformerEngine's MuonOptimizer (lr 3e-4, momentum 0.95,
Nesterov, weight decay 0.01 decoupled, quintic, 5 steps, spectral scale, eps 1e-7,
process_group, partition_dim), and the state is TE's (``state[p]["momentum_buffer"]``).
shardmuon adds weight_decay_mode (decoupled, l2, independent, none), custom coefficients,
replicated parameters (partition_dim=-1), uneven shards, CPU tensors, and ``ns_dtype``: the
dtype the update is orthogonalized in. By default it is the parameter's (float32 weights get a
float32 Newton-Schulz, the most accurate); ``ns_dtype=torch.bfloat16`` rounds the update to
bf16 for the iteration as torch.optim.Muon does, while weights and momentum stay float32: on
an H200 the iteration then runs at the bf16 tensor-core rate, about 10x float32's.

A parameter's sharding comes from its ``partition_dim`` attribute (as TransformerEngine and
Megatron mark tensor-parallel weights; Megatron's ``tensor_model_parallel=False`` means
replicated), else from its group's ``partition_dim``: 0 (column-parallel: rows split over the
group), 1 (row-parallel: columns split), or -1 (replicated). Shards may be uneven; their sizes
are exchanged once. In a group of one, every parameter is whole.

A DTensor parameter (torchtitan, FSDP2, PyTorch's tensor parallelism) carries its own split:
its placements say which dims are cut over which mesh dimensions, and the step uses the
process group of those dimensions' ranks (see ``_dtensor``; the ``process_group`` and group
``partition_dim`` options are for plain tensors). Its momentum buffer is a DTensor of the same placements, so that
``torch.distributed.checkpoint`` saves and reshards the state. Parameters over several process
groups are stepped in one library call per group: the arguments of all of them are checked
before the first, but an error the library finds in one group's call (ranks that disagree, a
timeout) leaves the parameters of the groups before it stepped. Parameters that must be
redistributed first (rows and columns cut over different mesh dimensions, as FSDP2 over a
row-parallel layer) join their group's call through copies, at most ``redistribution_bytes``
of them per rank at a time (parameter, gradient and momentum; default 1 GiB); the parameters
beyond that go to further calls over the same group.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import warnings
import weakref
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _capi as c
from ._dtensor import describe, is_dtensor, local_tensor, piece_bytes, redistributed, sharding, write_into
from ._runtime import Runtimes, checked_group, group_rank, group_size

__all__ = ["Muon", "MuonWithAdamW", "TorchMuon", "NewtonSchulz", "muon_param_groups", "load_resharded_state_dict"]

_DTYPES = {torch.float32: c.FLOAT32, torch.bfloat16: c.BFLOAT16, torch.float64: c.FLOAT64}
_NS_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _ns_storage(ns_dtype) -> int:
    """shardmuon_ns_storage of a group's ns_dtype: None, torch.bfloat16 or torch.float32 (or
    their names); a KeyError for anything else."""
    return c.NS_STORAGES[_NS_DTYPE_NAMES.get(ns_dtype, ns_dtype)]


class _PerTensor:
    """A dict keyed by tensor identity. Keyed by id() alone, an entry would outlive its tensor
    and be found by a later tensor given the same id; here each entry holds a weak reference
    that must still be that tensor. (A WeakKeyDictionary would compare tensors with ==, which
    torch makes element-wise.)"""

    def __init__(self):
        self._entries: Dict[int, Tuple[Any, Any]] = {}

    def _entry(self, tensor):
        """(weak reference, value) of this very tensor, or None."""
        entry = self._entries.get(id(tensor))
        return entry if entry is not None and entry[0]() is tensor else None

    def get(self, tensor, default=None):
        entry = self._entry(tensor)
        return default if entry is None else entry[1]

    def __contains__(self, tensor) -> bool:
        return self._entry(tensor) is not None

    def __getitem__(self, tensor):
        entry = self._entry(tensor)
        if entry is None:
            raise KeyError(f"tensor of shape {tuple(tensor.shape)}")
        return entry[1]

    def __setitem__(self, tensor, value) -> None:
        key = id(tensor)

        def forget(reference, entries=self._entries):  # when the tensor is collected
            if entries.get(key, (None,))[0] is reference:
                del entries[key]

        self._entries[key] = (weakref.ref(tensor, forget), value)


class _ParamName:
    """A parameter's name in error messages: its label (the name given with it, else where it
    is in param_groups), shape, dtype and device, formatted only when a message is (formatting
    one per parameter at every step was a measurable part of a small model's step)."""

    __slots__ = ("names", "param", "group_index", "index")

    def __init__(self, names, param: torch.Tensor, group_index: int, index: int):
        self.names, self.param, self.group_index, self.index = names, param, group_index, index

    @property
    def label(self) -> str:
        label = self.names.get(self.param)
        return f"param_groups[{self.group_index}]['params'][{self.index}]" if label is None else label

    def __str__(self) -> str:
        return f"{self.label} (shape {tuple(self.param.shape)}, {self.param.dtype}, {self.param.device})"


class _StepCache(NamedTuple):
    """What the last step built for the library, to build it again only where it changed.

    Checking every parameter and filling its C struct took about 16 us a parameter on an H200
    machine's host, before the first kernel of the step: gpt2's 48 matrices waited 0.5-0.8
    ms, up to a fifth of the eager step, with the GPU idle. A step that finds the parameters,
    their attributes and momentum buffers as the last step left them reuses its C arrays: it
    checks each parameter's address, shape, dtype, contiguity and attributes and each new
    gradient (the checks _entry makes of them), writes the gradients' addresses in, and
    rebuilds the groups' structs (their values may change at every step). Anything else
    found changed goes the full way, whose checks then say what is wrong. A DTensor parameter
    takes its split from its placements, mesh and global shape, so these are checked too (and
    the local pieces' addresses and shapes). Not kept for a step that redistributed a
    parameter (its copies are made for each step, see _regrouped)."""

    groups: List[Tuple[int, int, Any]]  # _membership of the Muon groups
    # Per parameter, in the order of the groups: (weak reference to it, its C struct, its
    # local piece's data_ptr and shape, dtype, device index, attributes, _placement of a
    # DTensor or None, weak reference to its momentum buffer or None when it had no gradient,
    # the buffer's local data_ptr). Weak references: a cache must not keep a replaced
    # momentum buffer alive (load_state_dict) until the next step.
    slots: List[tuple]
    calls: List[tuple]  # (context, comm, C array of params, their count, group indices, keepalive)


def _sharding_attributes(param) -> tuple:
    """The attributes by which a plain tensor says how it is split (see _entry)."""
    return (getattr(param, "partition_dim", None), getattr(param, "tensor_model_parallel", None),
            getattr(param, "muon_row_blocks", None), getattr(param, "muon_shape", None))


def _placement(tensor) -> Optional[tuple]:
    """What a DTensor's split is made of, for a _StepCache: (placements, mesh, global shape);
    None for a plain tensor."""
    return (tensor.placements, tensor.device_mesh, tensor.shape) if is_dtensor(tensor) else None


def _same_placement(tensor, cached, equal_mesh: bool = False) -> bool:
    """Whether a DTensor still has the _placement cached: its mesh the same object (a
    parameter's: the process group it is stepped over comes from it), or an equal one
    (`equal_mesh`: a gradient's, which the full checks compare by equality)."""
    placements, mesh, shape = cached
    return (tensor.placements == placements and tensor.shape == shape
            and (tensor.device_mesh is mesh or (equal_mesh and tensor.device_mesh == mesh)))


def _membership(muon_groups) -> List[Tuple[int, int, Any]]:
    """What a _StepCache keeps of the Muon groups: (index, parameter count, partition_dim)."""
    return [(index, len(group["params"]), group["partition_dim"]) for index, group in muon_groups]


def _stream_of(device: torch.device):
    """The library call's stream: the current CUDA stream's handle, or None on the CPU."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def _ordered_params(params, where: str) -> list:
    """`params` as a list; a set is refused, as torch.optim refuses it: its order differs
    between processes, and every rank must list the parameters in the same order (their
    shards are paired by position)."""
    if isinstance(params, set):
        raise TypeError(f"{where}: optimizer parameters need to be organized in ordered collections, "
                        f"but the ordering of tensors in sets will change between runs. Please use a "
                        f"list instead.")
    return list(params)


def _split_names(params, names: Optional[_PerTensor] = None):
    """Accepts tensors, dicts, or (name, tensor) pairs; returns torch's form and the names
    (added to `names` where given)."""
    if torch.is_tensor(params):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or "
                        f"dicts, but got {torch.typename(params)}")
    params = _ordered_params(params, "params")
    names = _PerTensor() if names is None else names

    def unpack(items):
        tensors = []
        for item in items:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                names[item[1]] = item[0]
                tensors.append(item[1])
            else:
                tensors.append(item)
        return tensors

    if params and isinstance(params[0], dict):
        groups = []
        for group in params:
            group = dict(group)
            tensors = group["params"]
            tensors = [tensors] if torch.is_tensor(tensors) else _ordered_params(
                tensors, f"param_groups[{len(groups)}]['params']")
            group["params"] = unpack(tensors)
            groups.append(group)
        return groups, names
    return unpack(params), names


def _any_nonfinite(tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A float32 1.0 on `device` if any element of `tensors` is NaN or Inf, else 0.0, computed
    there without waiting for it: their 1-norms, which a NaN or Inf makes non-finite, in one
    pass over each tensor. The norms must not overflow where no element does: a float16 or
    bfloat16 tensor's is summed into float32 (float16's own range ends at 65504, which three
    elements of 30000 pass); a float32 or float64 tensor's stays in its dtype (a finite float64
    1-norm can exceed float32's range), and each dtype's norms are checked in that dtype."""
    alike: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in tensors:
        alike.setdefault((t.device, t.dtype), []).append(t)
    flags = []
    for (_, dtype), group in alike.items():
        norm_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        try:
            norms = torch._foreach_norm(group, 1, dtype=norm_dtype)
        except (AttributeError, NotImplementedError, RuntimeError, TypeError):  # an older torch
            norms = [torch.linalg.vector_norm(t, 1, dtype=norm_dtype) for t in group]
        flags.append((~torch.isfinite(torch.stack(norms))).any().to(device))
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    flag = flags[0] if len(flags) == 1 else torch.stack(flags).any()
    return flag.to(torch.float32)


def _mark_modified_in_place(tensors: List[torch.Tensor]) -> None:
    """Moves the version counters of `tensors`, which the library wrote in place through their
    pointers, as an in-place torch operation would: autograd compares them with the versions
    it saved, so that a backward pass through a graph that saved a parameter before the step
    raises, as it does after torch.optim.SGD's step, instead of using the new values. PyTorch
    2.1 and later bump the counter directly; before, an in-place fill of an empty view shares
    and bumps the parameter's counter without touching an element (no kernel runs). A step
    skipped for a NaN moves them too: only the GPU knows of the skip without a wait."""
    increment = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
    with torch.no_grad():
        for tensor in tensors:
            if increment is not None:
                increment(tensor)
            else:
                tensor.view(-1)[:0].zero_()


def _all_gather_ints(values: List[int], process_group, device: torch.device) -> List[List[int]]:
    """Every rank's `values` ([rank][i]), by one all-gather over the group (on the GPU for an
    NCCL group, whose collectives take CUDA tensors)."""
    local = torch.tensor(values, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    gathered = [torch.empty_like(local) for _ in range(group_size(process_group))]
    dist.all_gather(gathered, local, group=process_group)
    return torch.stack(gathered).cpu().tolist()


def _is_real(value) -> bool:
    """A Python or NumPy number, not a bool (which is an int to Python)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_choice(group: Dict[str, Any], key: str, choices: Dict[str, int], where: str) -> None:
    value = group[key]
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{where}: unknown {key} {value!r} (one of {sorted(choices)})")


def _check_hyperparameters(group: Dict[str, Any], where: str, read_tensors: bool = True) -> None:
    """Raises a ValueError naming the group and the bad value (a wrong type included).
    read_tensors=False leaves a tensor learning rate unread (at a step, which may be captured
    in a CUDA graph: reading a CUDA tensor would synchronize)."""
    if not ((torch.is_tensor(group["lr"]) and group["lr"].numel() == 1) or _is_real(group["lr"])):
        raise ValueError(f"{where}: lr must be a number or a one-element tensor, got {group['lr']!r}")
    for key in ("momentum", "weight_decay", "extra_scale_factor", "eps"):
        if not _is_real(group[key]):
            raise ValueError(f"{where}: {key} must be a number, got {group[key]!r}")
    steps = group["num_ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise ValueError(f"{where}: num_ns_steps must be an int, got {steps!r}")
    # The library refuses what these refuse (infinities too), but only at the first step.
    if (read_tensors or not torch.is_tensor(group["lr"])) and not (0.0 <= float(group["lr"]) < math.inf):
        raise ValueError(f"{where}: invalid learning rate: {group['lr']} (must be finite and >= 0)")
    if not (0.0 <= group["momentum"] < 1.0):
        raise ValueError(f"{where}: invalid momentum value: {group['momentum']}")
    if not (0.0 <= group["weight_decay"] < math.inf):
        raise ValueError(f"{where}: invalid weight_decay value: {group['weight_decay']} (must be finite and >= 0)")
    if not math.isfinite(group["extra_scale_factor"]):
        raise ValueError(f"{where}: extra_scale_factor must be finite, got {group['extra_scale_factor']}")
    if not (0.0 <= group["eps"] < math.inf):
        raise ValueError(f"{where}: eps must be finite and >= 0, got {group['eps']}")
    if not (1 <= steps <= c.MAX_NS_ITERATIONS):
        raise ValueError(f"{where}: num_ns_steps must be in [1, {c.MAX_NS_ITERATIONS}], got {steps}")
    _check_choice(group, "coefficient_type", c.SCHEDULES, where)
    if group["coefficient_type"] == "custom":
        coefficients = group["custom_coefficients"]
        try:
            fits = len(coefficients) == steps and all(
                len(triple) == 3 and all(_is_real(x) for x in triple) for triple in coefficients)
        except TypeError:  # None, or not sequences
            fits = False
        if not fits:
            raise ValueError(f"{where}: coefficient_type='custom' needs custom_coefficients with one "
                             f"(a, b, c) per step ({group['num_ns_steps']}), got {coefficients!r}")
    _check_choice(group, "scale_mode", c.SCALE_MODES, where)
    decoupled, mode = group.get("use_decoupled_weight_decay"), group.get("weight_decay_mode")
    if decoupled is not None and not isinstance(decoupled, bool):
        raise ValueError(f"{where}: use_decoupled_weight_decay must be None, True or False, got {decoupled!r}")
    if mode is not None and (not isinstance(mode, str) or mode not in c.WEIGHT_DECAY_MODES):
        raise ValueError(f"{where}: unknown weight_decay_mode {mode!r} (one of {sorted(c.WEIGHT_DECAY_MODES)})")
    if decoupled is not None and mode is not None and mode != ("decoupled" if decoupled else "l2"):
        raise ValueError(f"{where}: use_decoupled_weight_decay={decoupled} contradicts "
                         f"weight_decay_mode={mode!r}")
    _check_choice(group, "algorithm", c.ALGORITHMS, where)
    try:
        _ns_storage(group.get("ns_dtype"))
    except (KeyError, TypeError):
        raise ValueError(f"{where}: ns_dtype must be None (the parameter's dtype), torch.bfloat16 or "
                         f"torch.float32, got {group.get('ns_dtype')!r}") from None
    if isinstance(group["partition_dim"], bool) or group["partition_dim"] not in (None, -1, 0, 1, "flat"):
        raise ValueError(f"{where}: partition_dim must be 0, 1, -1 (replicated) or \"flat\", got "
                         f"{group['partition_dim']!r}")


# torch.optim.AdamW's options that change what a step computes, beyond its numbers (lr,
# betas, eps, weight_decay): an AdamW group of MuonWithAdamW passes them on.
_ADAMW_SWITCHES = ("amsgrad", "maximize")


def _check_adamw_hyperparameters(group: Dict[str, Any], where: str) -> None:
    """An AdamW group's values (torch.optim.AdamW checks only its defaults): a ValueError naming
    the group and the bad value."""
    lr, betas, eps = group.get("lr"), group["betas"], group["eps"]
    if lr is not None and not torch.is_tensor(lr) and not (_is_real(lr) and lr >= 0.0):
        raise ValueError(f"{where}: lr must be a number of at least 0 or a tensor, got {lr!r}")
    try:
        fits = len(betas) == 2 and all(_is_real(b) and 0.0 <= b < 1.0 for b in betas)
    except TypeError:
        fits = False
    if not fits:
        raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    if not (_is_real(eps) and eps >= 0.0):
        raise ValueError(f"{where}: eps must be a number of at least 0, got {eps!r}")
    if not (_is_real(group["weight_decay"]) and group["weight_decay"] >= 0.0):
        raise ValueError(f"{where}: weight_decay must be a number of at least 0, got {group['weight_decay']!r}")
    for key in _ADAMW_SWITCHES:
        if not isinstance(group[key], bool):
            raise ValueError(f"{where}: {key} must be True or False, got {group[key]!r}")


def _weight_decay_mode(group: Dict[str, Any]) -> str:
    """weight_decay_mode wins; else TE's use_decoupled_weight_decay (True: decoupled, False: L2)."""
    mode = group.get("weight_decay_mode")
    if mode is not None:
        return mode
    return "l2" if group.get("use_decoupled_weight_decay") is False else "decoupled"


def _check_matrix_rank(param: torch.Tensor, group: Dict[str, Any], name: str) -> None:
    """Refuses a parameter Muon cannot take as a matrix: one of other than 2 or 3 dimensions,
    unless it is marked as a flat shard (by its group or its own partition_dim)."""
    flat = "flat" in (getattr(param, "partition_dim", None), group["partition_dim"])
    if param.ndim not in (2, 3) and not flat:
        raise ValueError(f"{name}: Muon takes 2D parameters, or 3D ones (experts x rows x "
                         "cols, each expert on its own), or flat shards (partition_dim "
                         "\"flat\"); train this one with AdamW (see MuonWithAdamW)")


class Muon(torch.optim.Optimizer):
    """Muon over 2D parameters that may be sharded across ``process_group``.

    Every rank of the group constructs the optimizer over its own shards of the same
    parameters in the same order and calls ``step`` together. A parameter whose ``grad`` is
    None is skipped on every rank (it must be None on all of them; the library checks).
    ``redistribution_bytes`` bounds the copies a step holds at a time of the DTensor
    parameters it redistributes (see the module's note). ``ns_batch_bytes`` bounds the
    workspace of one strided batch of Newton-Schulz (default 256 MiB): the same-shaped
    matrices a rank orthogonalizes by itself (a model's layers of one shape, experts) run in
    batches of as many as fit. Larger batches are faster for models of many small matrices
    (1 GiB on an H200: GPT-2 medium's and XL's steps 1-4% faster) for up to that much more
    GPU memory; every rank must pass the same value.

    ``nonfinite`` says what a step does with a NaN or Inf: "skip" (the default) skips the
    whole step on every rank when any gradient is not finite (nothing written), else only a
    parameter whose orthogonalized update is not finite, found on the GPU without waiting for
    it; "raise" does the same, waits for the step's end, and raises a ShardmuonError (status
    ``ERROR_NON_FINITE``) naming what was skipped; "proceed" checks nothing (the fastest).
    ``nonfinite_counts()`` says how many steps and parameters were skipped. A step of
    parameters in several process groups (DTensors on several mesh dimensions) makes one
    library call per group; before the first, the step flag is summed over each group in
    turn (shardmuon_context_reduce_step_flag), so that all of them skip or none does (on a
    mesh: every rank holds the whole step's verdict). Another optimizer over the other
    parameters knows nothing of it: use MuonWithAdamW, which skips both, or read the counts.

    Under ``torch.amp.GradScaler`` (float16 training; PyTorch 2.1 and later) ``scaler.step``
    hands the step the scale and its found_inf instead of reading found_inf on the host: the
    step divides the gradients by the scale in place (as ``scaler.unscale_`` would) and skips
    on found_inf on the GPU, on every rank of its process group (one rank's overflow skips
    them all), under any ``nonfinite`` policy, and counts it; nothing waits. The scale itself
    is the scaler's, updated from each rank's own found_inf: where ranks hold different
    gradients (tensor parallelism, FSDP), their scales stay equal only if the scaler agrees
    found_inf across them. FSDP's ShardedGradScaler does so in ``unscale_``, which this
    protocol skips: call ``scaler.unscale_(optimizer)`` before ``scaler.step(optimizer)``
    there (as gradient clipping does anyway).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        *,
        use_decoupled_weight_decay: Optional[bool] = None,
        weight_decay_mode: Optional[str] = None,
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        custom_coefficients: Optional[Sequence[Sequence[float]]] = None,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        eps: float = 1e-7,
        process_group=None,
        partition_dim: Optional[int] = None,
        algorithm: str = "auto",
        redistribution_bytes: int = 1 << 30,
        ns_dtype: Optional[torch.dtype] = None,
        ns_batch_bytes: int = 256 << 20,
        nonfinite: str = "skip",
    ):
        params, self._param_names = _split_names(params)
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            use_decoupled_weight_decay=use_decoupled_weight_decay,
            weight_decay_mode=weight_decay_mode, coefficient_type=coefficient_type,
            num_ns_steps=num_ns_steps, custom_coefficients=custom_coefficients,
            scale_mode=scale_mode, extra_scale_factor=extra_scale_factor, eps=eps,
            partition_dim=partition_dim, algorithm=algorithm, ns_dtype=ns_dtype,
        )
        _check_hyperparameters(defaults, "Muon")
        if isinstance(redistribution_bytes, bool) or not isinstance(redistribution_bytes, int) \
                or redistribution_bytes < 0:
            raise ValueError(f"Muon: redistribution_bytes must be a non-negative int, got {redistribution_bytes!r}")
        self._redistribution_bytes = redistribution_bytes
        if isinstance(ns_batch_bytes, bool) or not isinstance(ns_batch_bytes, int) or ns_batch_bytes < 0:
            raise ValueError(f"Muon: ns_batch_bytes must be a non-negative int, got {ns_batch_bytes!r}")
        if nonfinite not in c.NONFINITE_POLICIES:
            raise ValueError(f"Muon: nonfinite must be one of {sorted(c.NONFINITE_POLICIES)}, got {nonfinite!r}")
        self._nonfinite = nonfinite
        self.process_group = checked_group(process_group, "Muon")
        super().__init__(params, defaults)  # checks each group (add_param_group)
        self._runtimes = Runtimes(ns_batch_bytes, c.NONFINITE_POLICIES[nonfinite])
        # Steps a subclass skipped without a library call that counts them (a device tensor).
        self._steps_skipped_here: Optional[torch.Tensor] = None
        # What the library counted twice: a skipped step of several calls counts in each.
        self._extra_skip_counts: Optional[torch.Tensor] = None
        self._scaler_checked = False  # whether a loss scaler's found_inf covers the gradients
        self._called_library = False  # in the current step
        self._shard_sizes = _PerTensor()  # of the sharded parameters: every rank's extent
        self._seen = _PerTensor()  # the parameters whose shard sizes every rank has exchanged
        self._gather_notes = set()  # the ones warned of (see _dtensor_entry)
        self._step_cache: Optional[_StepCache] = None  # see _StepCache

    def __getstate__(self):
        """Refused: the optimizer holds library handles and a process group, which neither a
        copy nor a pickle can carry (torch.optim.Optimizer's own pickling would keep only
        the state and groups, and the copy would fail at its first step)."""
        raise TypeError(f"{type(self).__name__} cannot be copied or pickled: it holds library handles "
                        "and a process group. Save and load optimizer.state_dict() instead (or "
                        "torch.distributed.checkpoint for DTensor parameters).")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch.optim's, and the group's values checked: a bad one raises a ValueError naming
        it, and the group is not added. Its params may be (name, tensor) pairs, as in the
        constructor."""
        if isinstance(param_group, dict) and isinstance(param_group.get("params"), (list, tuple)):
            [param_group], _ = _split_names([param_group], self._param_names)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        where = f"Muon param_groups[{index}]"
        group = self.param_groups[index]
        try:
            _check_hyperparameters(self._hyperparameters(group, where), where)
            if any(i == index for i, _ in self._muon_groups()):
                # As torch.optim.Muon does: a bias or a norm's weight passed by mistake fails
                # here, not at the first step.
                for position, param in enumerate(group["params"]):
                    _check_matrix_rank(param, group, self._name(param, index, position))
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch.optim's, after the saved groups are found to be of this class's form (see
        _check_saved_groups): a state dict of the other form would load, then fail at the
        first step."""
        self._check_saved_groups(state_dict["param_groups"])
        super().load_state_dict(state_dict)

    # -- helpers ------------------------------------------------------------------------------

    def _check_saved_groups(self, groups: List[Dict[str, Any]]) -> None:
        """Refuses groups saved by TorchMuon or torch.optim.Muon, which name the iteration by
        ns_coefficients, ns_steps and adjust_lr_fn instead of Muon's names."""
        for index, group in enumerate(groups):
            foreign = sorted(set(group) & {"ns_coefficients", "ns_steps", "adjust_lr_fn"})
            if foreign and "coefficient_type" not in group:
                raise ValueError(f"{type(self).__name__}: the state dict's param_groups[{index}] has "
                                 f"{', '.join(foreign)}: it was saved by TorchMuon or torch.optim.Muon "
                                 "(load it into shardmuon.torch.TorchMuon)")

    def _name(self, param: torch.Tensor, group_index: int, index: int) -> str:
        """The parameter's label with what an error message needs: shape, dtype and device."""
        return str(_ParamName(self._param_names, param, group_index, index))

    def _hyperparameters(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        """A group's values under Muon's names (TorchMuon derives some from torch.optim.Muon's)."""
        return group

    def _muon_groups(self):
        """(index, group) of the groups this class steps (MuonWithAdamW leaves out the others)."""
        return list(enumerate(self.param_groups))

    def _partition_dim(self, param, group, name):
        """0, 1, "flat", or None (replicated) for the matrix the library sees."""
        attribute = getattr(param, "partition_dim", None)
        if getattr(param, "tensor_model_parallel", None) is False:
            attribute = -1  # Megatron: not tensor-parallel
        chosen = group["partition_dim"]
        if attribute is not None:
            if chosen is not None and chosen != attribute:
                raise ValueError(f"{name}: its partition_dim attribute is {attribute} but its group "
                                 f"says {chosen}")
            chosen = attribute
        if chosen == "flat":
            # ZeRO / distributed-optimizer sharding: this rank holds a range of the row-major
            # elements of a muon_shape matrix, as a 1D tensor.
            if param.ndim != 1 or getattr(param, "muon_shape", None) is None:
                raise ValueError(f"{name}: a flat shard is a 1D tensor of a range of the matrix's "
                                 "row-major elements, with a muon_shape = (rows, cols) attribute")
            return "flat"
        if param.ndim == 3:
            # Experts x rows x cols: each rank holds every expert's rows and a block of columns
            # (partition_dim 2), or everything (-1); the library sees the (E rows) x cols stack.
            if chosen not in (None, -1, 2):
                raise ValueError(f"{name}: a 3D (experts x rows x cols) parameter takes partition_dim "
                                 f"2 (columns split) or -1 (replicated), got {chosen}")
            chosen = 1 if chosen == 2 else chosen
        elif chosen not in (None, -1, 0, 1):
            raise ValueError(f"{name}: partition_dim must be 0, 1, -1 (replicated) or \"flat\", "
                             f"got {chosen!r}")
        if chosen is None and group_size(self.process_group) > 1:
            raise ValueError(
                f"{name}: tell how it is split over the process_group of "
                f"{group_size(self.process_group)} ranks: a partition_dim attribute or group "
                "option of 0 (rows split), 1 (columns split), -1 (replicated) or \"flat\" (a "
                "range of the row-major elements, ZeRO style)")
        return None if chosen in (None, -1) else chosen

    def _exchange_shard_sizes(self, bucket, device, process_group, failure):
        """Before the first step of parameters not seen before, every rank of the group learns
        every rank's extent along the split. A header goes first, of fixed size, in which each
        rank says whether it failed and how many parameters it brings: then a rank whose checks
        failed (`failure`) or ranks that list other parameters give every rank of the group a
        failure, which this returns (the caller still makes the collectives of the other
        groups before raising it, see _calls), instead of some waiting in a collective the
        others never make."""
        new = [e for e in bucket if e["param"] not in self._seen]
        if not new:
            return failure
        missing = [e for e in bucket if not e["stub"] and e["regroup"] is None and e["dim"] is not None
                   and e["param"] not in self._shard_sizes]
        if group_size(process_group) > 1:
            header = _all_gather_ints([int(failure is not None), len(new), len(missing)], process_group,
                                      device)
            failed = [rank for rank, row in enumerate(header) if row[0]]
            if failure is not None:
                return failure
            if failed:
                return ValueError(f"Muon: rank(s) {failed} of the process group of {len(header)} ranks "
                                  "rejected the step's parameters (their own errors say why); nothing "
                                  "was stepped")
            if any(row[1:] != header[0][1:] for row in header):
                counts = [tuple(row[1:]) for row in header]
                return ValueError(f"Muon: the ranks of a process group list different parameters "
                                  f"(new ones, sharded ones, by rank: {counts}); every rank must pass "
                                  "the same parameters, split the same way; nothing was stepped")
        elif failure is not None:
            return failure
        self._gather_shard_sizes(missing, device, process_group)
        for e in new:
            self._seen[e["param"]] = True
        return None

    def _before_first_call(self, device, process_groups, calls, grads, failure=None):
        """What every rank of the step does before its first library call, on every rank alike
        (its collectives depend only on the process groups, the same on every rank): loads the
        step flag, and where the calls are over several groups, sums it over each of them
        in turn, so that every rank holds the verdict of the whole step before any call
        writes; without it a call reads only its own group's gradients and the verdicts of the
        calls before it, so that a NaN on another group's rank skipped the calls from there
        on, not those before, and under "raise" left the ranks outside that group waiting in
        the next call. Where the step makes several calls, this rank's flag includes whether
        any of its gradients (`grads`, the local pieces) is not finite: the first call would
        see only its own.

        A failure of this rank (`failure`) reaches the others the same way: it enters each
        group's reduction, or the first call where there is one group, with arguments the
        library refuses (a negative parameter count), whose agreement fails them there; a rank
        told so does the same for the groups after, and raises. So a check that fails on one
        rank ends the step on every rank of its groups before anything is written."""
        shared = [g for g in process_groups if group_size(g) > 1]
        reduced = len(process_groups) > 1 and bool(shared)  # alike on every rank
        if failure is None:
            checked = self._step_policy != "proceed"
            # A loss scaler's found_inf covers this rank's gradients already (GradScaler checks
            # them all before the step when scaler.unscale_ has not).
            if checked and calls > 1 and grads and not self._scaler_checked:
                self._flag_inputs.append(_any_nonfinite(grads, device))
            self._verdict = self._load_step_flag(device, always=checked and reduced)
        if not reduced:
            if failure is not None:
                if shared:  # a group of one rank has no one waiting
                    self._fail_first_call(shared[0], device)
                raise failure
            return
        context = self._runtimes.context(device)
        context.set_nonfinite_policy(c.NONFINITE_POLICIES[self._step_policy])  # as the calls'
        stream = _stream_of(device)
        for group in shared:
            if failure is not None:
                self._fail_first_call(group, device)
                continue
            _, comm = self._runtimes.get(device, group)
            status = c.lib.shardmuon_context_reduce_step_flag(context.handle, comm.handle, stream)
            try:
                comm.raise_callback_error()
                c.check(status)
            except Exception as error:  # a peer's failure (PEER_FAILED), or its collective's
                failure = error
        if failure is not None:
            raise failure

    def _fail_first_call(self, process_group, device):
        """Enters the library call the other ranks of the group are about to make (a step, or
        a step flag reduction) with arguments it refuses (a negative parameter count): its
        agreement returns PEER_FAILED on them."""
        context, comm = self._runtimes.get(device, process_group)
        group = c.MuonGroup()
        c.check(c.lib.shardmuon_muon_group_default(ctypes.byref(group)))
        stream = _stream_of(device)
        c.lib.shardmuon_muon_step(context.handle, comm.handle, None, -1, ctypes.byref(group), 1, stream)
        comm.clear_callback_error()

    def _gather_shard_sizes(self, entries, device, process_group):
        """Exchanges the local extents of the sharded parameters not seen before: one
        collective for all of them, made by every rank of the group in the same order."""
        missing = [e for e in entries if e["dim"] is not None and e["param"] not in self._shard_sizes]
        if not missing or group_size(process_group) == 1:
            for e in missing:
                self._shard_sizes[e["param"]] = [e["extent"]]
            return
        table = _all_gather_ints([e["extent"] for e in missing], process_group, device)
        for column, e in enumerate(missing):
            self._shard_sizes[e["param"]] = [row[column] for row in table]

    def _dtensor_entry(self, param, name, local=None):
        """Where a DTensor parameter's sharding comes from: its placements (see _dtensor).
        `local`: the piece the library will see, when not the parameter's own (a regrouped
        copy)."""
        blocks = int(getattr(param, "muon_row_blocks", 1))  # a fused 2D weight's stacked parts
        how = sharding(param, name, blocks)
        process_group, tensor_dim, experts = how.process_group, how.dim, how.experts
        attribute = getattr(param, "partition_dim", None)
        declared = -1 if tensor_dim is None else tensor_dim
        if how.regroup is None and attribute is not None and attribute != declared:
            raise ValueError(f"{name}: its partition_dim attribute is {attribute!r} but it is a DTensor "
                             f"with {describe(param)}")
        if local is None:
            local = param.to_local()
        if param.ndim == 3:  # the library sees this rank's experts stacked: (E rows) x cols
            shape = (local.shape[0] * local.shape[1], param.shape[2] if tensor_dim == 2 else local.shape[2])
            dim = None if tensor_dim is None else 1
        else:
            shape = tuple(param.shape) if tensor_dim is not None else tuple(local.shape)
            dim = tensor_dim
        extent = None if tensor_dim is None else local.shape[tensor_dim]
        row_blocks = experts if param.ndim == 3 else blocks
        if how.note is not None and how.note not in self._gather_notes:
            self._gather_notes.add(how.note)  # once: the same for every parameter cut so
            warnings.warn(f"Muon: {name} (and any other parameter cut the same way): {how.note}",
                          stacklevel=2)
        return process_group, dim, shape, extent, row_blocks, how.regroup

    def _regrouped(self, e):
        """A DTensor parameter whose split the library cannot take as it is (rows and columns
        cut over different mesh dimensions, say), redistributed with its gradient and momentum
        to placements it can take (see _dtensor.sharding): the entry of those copies, and a
        function that writes the stepped copies back into the parameter and its momentum."""
        param, target, name = e["param"], e["regroup"], e["name"]
        param_copy = redistributed(param, target)
        grad_copy = momentum = momentum_copy = None
        if e["grad"] is not None:
            momentum = self._momentum(param, e["local"], name)
            grad_copy = redistributed(param.grad, target)
            momentum_copy = redistributed(momentum, target)
        local = param_copy.to_local()
        process_group, dim, shape, extent, row_blocks, _ = self._dtensor_entry(param, name, local)
        entry = dict(e, local=local, grad=None if grad_copy is None else grad_copy.to_local(),
                     process_group=process_group, dim=dim, shape=shape, extent=extent,
                     row_blocks=row_blocks)
        if momentum_copy is not None:
            entry["momentum"] = momentum_copy.to_local()

        def write_back():
            write_into(param, param_copy)
            if momentum is not None:
                write_into(momentum, momentum_copy)

        return entry, write_back

    def _collect(self):
        """The step's parameters as entries, and this rank's first error. A parameter that
        fails its checks here becomes a stub (its process group only) and its error is
        returned, not raised: this rank must still take part in the collectives its peers make
        before they can learn of it (see _calls). An error in finding the process group itself
        is raised: it comes from the parameters' placements, alike on every rank."""
        entries, failure = [], None
        for group_index, group in self._muon_groups():
            for index, param in enumerate(group["params"]):
                if self._no_matrix(param, group):
                    continue
                name = _ParamName(self._param_names, param, group_index, index)
                try:
                    entry = self._entry(param, group, group_index, name)
                except (ValueError, TypeError) as error:
                    failure = failure or error
                    entry = {"param": param, "stub": True, "group": group_index, "name": name,
                             "process_group": self._process_group_of(param, name)}
                entries.append(entry)
        return entries, failure

    def _no_matrix(self, param, group) -> bool:
        """Whether the parameter's matrix has no element on any rank (a (0, n) weight, a stack
        of no experts): nothing to step, as torch's optimizers step nothing there, and no
        library call (which refuses an empty matrix). Decided from what every rank knows
        alike, whatever its own piece: a rank's piece of a split matrix may be empty alone."""
        if param.numel() != 0:
            return False
        if is_dtensor(param) or group_size(self.process_group) == 1:  # numel is the whole matrix's
            return True
        try:
            dim = self._partition_dim(param, group, "")
        except ValueError:
            return False  # _entry raises it, naming the parameter
        if dim == "flat":
            return math.prod(int(x) for x in param.muon_shape) == 0
        if dim in (0, 1) and param.ndim == 2:
            return param.shape[1 - dim] == 0  # the side no rank splits
        if dim == 1 and param.ndim == 3:  # experts x rows x a block of columns
            return param.shape[0] * param.shape[1] == 0
        return param.ndim in (2, 3)  # not split: the whole of it is here

    def _process_group_of(self, param, name):
        if is_dtensor(param):
            return sharding(param, name, int(getattr(param, "muon_row_blocks", 1))).process_group
        return self.process_group

    def _entry(self, param, group, group_index: int, name):
        """A parameter's entry: its checks on this rank, and the matrix the library sees."""
        _check_matrix_rank(param, group, name)  # again: its .data or its group may have changed
        blocks = getattr(param, "muon_row_blocks", None)
        if param.ndim == 3 and blocks not in (None, 1, param.shape[0]):  # 1: nothing to split
            raise ValueError(f"{name}: muon_row_blocks ({blocks!r}) is for 2D weights; a 3D parameter's "
                             f"matrices are its {param.shape[0]} experts (dim 0)")
        if param.dtype not in _DTYPES or (param.dtype == torch.float64 and param.is_cuda):
            raise TypeError(f"{name}: Muon takes float32 or bfloat16 parameters (float64 on "
                            f"the CPU), got {param.dtype}")
        dtensor = is_dtensor(param)
        local = param.to_local() if dtensor else param  # what the library reads and writes
        if not local.is_contiguous():
            raise ValueError(f"{name}: the parameter is not contiguous")
        grad = param.grad
        if grad is not None:
            if grad.dtype != param.dtype:
                raise TypeError(f"{name}: its gradient is {grad.dtype}, the parameter {param.dtype}")
            if grad.shape != param.shape:
                raise ValueError(f"{name}: its gradient has shape {tuple(grad.shape)}")
            grad_dtensor = is_dtensor(grad)
            if dtensor != grad_dtensor or (
                    dtensor and (grad.placements != param.placements or grad.device_mesh != param.device_mesh)):
                raise ValueError(f"{name}: its gradient is "
                                 f"{describe(grad) if grad_dtensor else 'not a DTensor'}, "
                                 f"the parameter {describe(param) if dtensor else 'not a DTensor'}")
            if grad_dtensor:
                grad = grad.to_local()
            if grad.shape != local.shape:
                raise ValueError(f"{name}: its gradient's local piece has shape {tuple(grad.shape)}, "
                                 f"the parameter's {tuple(local.shape)}")
            if grad.device != local.device:
                raise ValueError(f"{name}: its gradient is on {grad.device}")
            if grad.is_sparse or not grad.is_contiguous():
                raise ValueError(f"{name}: its gradient is not a contiguous dense tensor")
        # The matrix the library sees, and how many matrices are stacked in its rows:
        # the experts of a 3D parameter, or a fused weight's parts (muon_row_blocks,
        # e.g. the heads of QKV or the gate and up halves).
        regroup = None
        if dtensor:
            process_group, dim, shape, extent, row_blocks, regroup = self._dtensor_entry(param, name)
        else:
            process_group = self.process_group
            dim = self._partition_dim(param, group, name)
            if param.ndim == 3:
                shape, row_blocks = (param.shape[0] * param.shape[1], param.shape[2]), param.shape[0]
            elif dim == "flat":
                shape = tuple(int(x) for x in param.muon_shape)
                row_blocks = int(getattr(param, "muon_row_blocks", 1))
            else:
                shape, row_blocks = tuple(param.shape), int(getattr(param, "muon_row_blocks", 1))
            # This rank's extent along the split: rows or columns, or elements when flat.
            extent = None if dim is None else param.numel() if dim == "flat" else shape[dim]
        return {"param": param, "local": local, "grad": grad, "group": group_index, "name": name,
                "process_group": process_group, "dim": dim, "shape": shape, "extent": extent,
                "row_blocks": row_blocks, "regroup": regroup, "stub": False}

    def _calls(self, entries, device, failure=None, join_first_call=False):
        """The library calls of a step over `entries`, in the same order on every rank (each
        rank lists the same parameters): (entries, step arguments, write_backs). One call per
        process group, in the order the groups first appear, over all its parameters, so that
        the owners share out all of the group's matrices. Built and checked here, before any
        call: the arguments of the parameters the library takes as they are, and the momentum
        buffers of the regrouped ones. The regrouped parameters' copies (see _regrouped) are
        made just before their call: the redistribution is a collective, and the copies live
        only for the call. They may hold at most `redistribution_bytes` per rank at a time;
        the regrouped parameters beyond that go to further calls over the same group. After a
        call, each write_back() puts a copy's results in place.

        A check that fails on this rank only (`failure` from _collect, or one here) must not
        leave the others waiting in a collective: this rank still makes the collectives they
        make before their first call (the shard-size exchanges, whose headers carry the
        failure to every rank of their group, and the communicators' creation), and then those
        of _before_first_call (join_first_call; plan() makes no call), which carry it to every
        rank of the step. Then it raises its error."""
        buckets: Dict[Any, list] = {}
        for e in entries:
            buckets.setdefault(e["process_group"], []).append(e)
        prepared = []
        for process_group, bucket in buckets.items():
            failure = self._exchange_shard_sizes(bucket, device, process_group, failure)
            runtime = self._runtimes.get(device, process_group)  # collective on first use
            if failure is not None:
                continue
            try:
                as_is = [e for e in bucket if e["regroup"] is None]
                regrouped = [e for e in bucket if e["regroup"] is not None]
                for e in regrouped:
                    if e["grad"] is not None:
                        self._momentum(e["param"], e["local"], e["name"])
                indices = sorted({e["group"] for e in bucket})
                prepared.append((process_group, as_is, self._step_arguments(as_is, runtime, process_group, indices),
                                 self._redistribution_runs(regrouped)))
            except (ValueError, TypeError) as error:
                failure = error
        if join_first_call:
            grads = [e["grad"] for e in entries if not e["stub"] and e["grad"] is not None]
            self._before_first_call(device, list(buckets), sum(len(p[3]) for p in prepared), grads, failure)
        if failure is not None:
            raise failure

        def calls():
            for process_group, as_is, (context, comm, params, groups, keepalive), runs in prepared:
                for run in runs:
                    copies, write_backs = [], []
                    for e in run:
                        entry, write_back = self._regrouped(e)
                        copies.append(entry)
                        write_backs.append(write_back)
                    if copies:
                        more = self._param_structs(copies, device, process_group, keepalive)
                        params = (c.MuonParam * (len(params) + len(more)))(*params, *more)
                    yield as_is + copies, (context, comm, params, groups, keepalive), write_backs
                    as_is, params = [], []  # stepped by the first call

        return calls()

    def _redistribution_runs(self, regrouped):
        """The regrouped entries of one process group cut into runs whose copies (parameter,
        gradient and momentum) take at most `redistribution_bytes` on a rank, at least one
        entry each; one empty run where there are none. Sized by the global shapes, so every
        rank cuts the same runs."""
        runs, run, held = [], [], 0
        for e in regrouped:
            size = 3 * piece_bytes(e["param"], e["regroup"])
            if run and held + size > self._redistribution_bytes:
                runs.append(run)
                run, held = [], 0
            run.append(e)
            held += size
        runs.append(run)
        return runs

    @staticmethod
    def _device(entries) -> torch.device:
        def device_of(e):
            return local_tensor(e["param"]).device if e["stub"] else e["local"].device

        devices = {device_of(e) for e in entries}
        if len(devices) > 1:
            by_device = {}
            for e in entries:
                by_device.setdefault(device_of(e), e["name"])
            listing = "; ".join(f"{name} on {device}" for device, name in by_device.items())
            raise ValueError(f"Muon: all parameters must be on one device (CPU or one GPU): {listing}")
        return devices.pop()

    def _group_struct(self, group, keepalive, device, index) -> c.MuonGroup:
        # Checked again at every step: a group's values may have changed since (schedulers).
        where = f"Muon param_groups[{index}]"
        group = self._hyperparameters(group, where)
        _check_hyperparameters(group, where, read_tensors=False)
        s = c.MuonGroup()
        c.check(c.lib.shardmuon_muon_group_default(ctypes.byref(s)))
        lr = group["lr"]
        if torch.is_tensor(lr):
            # A tensor learning rate (PyTorch's schedulers fill it in place) is read by the
            # step's kernels when they run: a step captured with torch.cuda.graph follows it.
            if lr.dtype != torch.float32 or lr.numel() != 1 or lr.device != device:
                raise ValueError(f"{where}: a tensor lr must be one float32 value on {device}, not "
                                 f"{lr.dtype} x {lr.numel()} on {lr.device}")
            s.lr = 0.0
            s.lr_on_device = lr.data_ptr()
        else:
            s.lr = float(lr)
        s.momentum = float(group["momentum"])
        s.nesterov = 1 if group["nesterov"] else 0
        s.weight_decay = float(group["weight_decay"])
        s.weight_decay_mode = c.WEIGHT_DECAY_MODES[_weight_decay_mode(group)]
        s.scale_mode = c.SCALE_MODES[group["scale_mode"]]
        s.extra_scale_factor = float(group["extra_scale_factor"])
        s.ns.num_iterations = int(group["num_ns_steps"])
        s.ns.schedule = c.SCHEDULES[group["coefficient_type"]]
        s.ns.eps = float(group["eps"])
        s.ns.algorithm = c.ALGORITHMS[group["algorithm"]]
        s.ns_storage = _ns_storage(group.get("ns_dtype"))
        if group["coefficient_type"] == "custom":
            flat = [float(x) for triple in group["custom_coefficients"] for x in triple]
            array = (ctypes.c_double * len(flat))(*flat)
            keepalive.append(array)
            s.ns.custom_coefficients = array
            s.ns.num_custom_coefficients = len(flat) // 3
        return s

    # -- the step -----------------------------------------------------------------------------

    def nonfinite_counts(self) -> Dict[str, int]:
        """Steps skipped because a gradient was not finite (``skipped_steps``), and parameters
        skipped because their update was not finite (``skipped_params``), so far; waits for
        the GPU. See ``nonfinite``."""
        steps = 0 if self._steps_skipped_here is None else int(self._steps_skipped_here.item())
        if self._extra_skip_counts is not None:
            steps -= int(self._extra_skip_counts.item())
        params = 0
        for context in self._runtimes.contexts():
            context_steps, context_params = context.nonfinite_counts()
            steps, params = steps + context_steps, params + context_params
        return {"skipped_steps": steps, "skipped_params": params}

    # torch.amp.GradScaler's protocol for optimizers that handle loss scaling themselves,
    # declared from PyTorch 2.1 (PyTorch 1.x's GradScaler passes itself as a step() argument
    # instead, which this step does not take: there the scaler's ordinary path runs). Instead
    # of unscaling the gradients and reading whether they hold an Inf or NaN on the host, which
    # makes the host wait for the backward pass, GradScaler sets two attributes for the step:
    # grad_scale (the scale the gradients carry, or None when scaler.unscale_ has already
    # removed it) and found_inf (a float32 tensor, non-zero when this rank's gradients of this
    # optimizer hold an Inf or NaN). See step().
    _step_supports_amp_scaling = torch.__version__ >= (2, 1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._called_library = False
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        # Under a loss scaler an Inf is routine (its scale was too large): the step skips on
        # found_inf, whatever the policy, as GradScaler skips any optimizer's step.
        self._step_policy = self._nonfinite if found_inf is None else "skip"
        self._flag_inputs: List[torch.Tensor] = [] if found_inf is None else [found_inf]
        self._scaler_checked = found_inf is not None
        self._check_other_steps()
        self._grad_scale = grad_scale  # removed just before the first write (_unscale_once)
        self._verdict = None
        self._muon_step()
        _mark_modified_in_place([p for _, group in self._muon_groups() for p in group["params"]
                                 if p.grad is not None])
        self._unscale_once()
        self._other_steps()
        return loss

    def _unscale_once(self) -> None:
        """Removes a loss scaler's scale from the gradients, once a step, just before the
        first library call (or AdamW's step): after every argument has been checked, so that a
        step refused for bad input leaves the gradients as they were."""
        if self._grad_scale is not None:
            self._unscale_gradients(self._grad_scale)
            self._grad_scale = None

    def _unscale_gradients(self, grad_scale: torch.Tensor) -> None:
        """Divides every gradient of this optimizer by a loss scaler's scale, in place and on
        the device, as GradScaler.unscale_ does: times the scale's float32 reciprocal (taken in
        float64), so that the gradients are the ones its ordinary path would step with."""
        inverse = grad_scale.double().reciprocal().float().reshape(())
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = local_tensor(p.grad)
                    by_device.setdefault(grad.device, []).append(grad)
        for device, grads in by_device.items():
            factor = inverse.to(device, non_blocking=True)
            try:
                torch._foreach_mul_(grads, factor)
            except (RuntimeError, TypeError):  # grads of several dtypes, or no tensor overload
                for grad in grads:
                    grad.mul_(factor)

    def _load_step_flag(self, device: torch.device, always: bool = False) -> Optional[torch.Tensor]:
        """Before this step's library calls: the step flag of the context they use
        (shardmuon_context_set_step_flag) holds the sum of this step's flag inputs (a loss
        scaler's found_inf, MuonWithAdamW's check of its AdamW gradients, this rank's check of
        its gradients), moved to `device`, which the calls read as one more gradient; None
        where there is none, unless `always` (a flag left from an earlier step is cleared: it
        holds that step's verdict)."""
        context = self._runtimes.context(device)
        if not self._flag_inputs and not always:
            if context.step_flag is not None:
                context.step_flag.zero_()
            return None
        if context.step_flag is None:
            context.use_step_flag(torch.zeros(1, dtype=torch.float32, device=device))
        if self._flag_inputs:
            context.step_flag.copy_(self._summed_flag_inputs(device))
        else:
            context.step_flag.zero_()
        return context.step_flag

    def _summed_flag_inputs(self, device: torch.device) -> torch.Tensor:
        """How many of the flag inputs are set (non-zero, NaN included): set inputs of opposite
        signs cannot cancel."""
        inputs = torch.stack([x.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
                              for x in self._flag_inputs])
        return inputs.ne(0).sum().to(torch.float32)

    def _check_other_steps(self):
        """What a subclass checks of its other steps before the Muon step writes anything."""

    def _other_steps(self):
        """What a subclass steps besides the Muon groups (MuonWithAdamW: its AdamW groups)."""

    def _muon_step(self):
        reused = self._last_calls_again()
        if reused is not None:
            device, calls, grads = reused
            stream = _stream_of(device)
            self._before_first_call(device, [comm.group for _, comm, *_ in calls], len(calls), grads)
            for context, comm, params, count, groups, _ in calls:
                self._call_step(context, comm, params, count, groups, stream)
            self._count_a_skipped_step_once(len(calls))
            return
        self._step_cache = None
        entries, failure = self._collect()
        if not entries:  # no library call: the verdict is this rank's own
            if self._flag_inputs:
                self._verdict = self._summed_flag_inputs(self._flag_inputs[0].device)
            return
        device = self._device(entries)
        stream = _stream_of(device)
        # One call per process group (DTensor parameters may live on several mesh dimensions),
        # after _before_first_call has given every rank the whole step's verdict. The calls'
        # arguments are built and checked before the first call, so that an error found here
        # steps none; regrouped parameters' copies are made just before their call (see
        # _calls).
        made = []
        for bucket, arguments, write_backs in self._calls(entries, device, failure, join_first_call=True):
            # keepalive: what params and groups point into, alive until the call returns.
            context, comm, params, groups, keepalive = arguments
            self._call_step(context, comm, params, len(bucket), groups, stream)
            for write_back in write_backs:
                write_back()
            made.append((bucket, arguments))
        self._count_a_skipped_step_once(len(made))
        if all(e["regroup"] is None for e in entries):
            self._step_cache = self._remember(made)

    def _count_a_skipped_step_once(self, calls: int) -> None:
        """Each of the step's `calls` counts a skipped step in the library (all of them skip,
        see _before_first_call): the counts the other calls added, on the device, so that
        nonfinite_counts() counts steps. Under "raise" the first call raises on every rank."""
        verdict = self._verdict
        if calls > 1 and verdict is not None and self._step_policy == "skip":
            extra = (verdict.reshape(()) != 0).to(torch.int64) * (calls - 1)
            counted = self._extra_skip_counts
            self._extra_skip_counts = extra if counted is None else counted + extra

    def _call_step(self, context, comm, params, count, groups, stream):
        self._unscale_once()
        self._called_library = True
        context.set_nonfinite_policy(c.NONFINITE_POLICIES[self._step_policy])
        status = c.lib.shardmuon_muon_step(context.handle, comm.handle, params, count, groups,
                                           len(self.param_groups), stream)
        comm.raise_callback_error()
        c.check(status)

    def _remember(self, made) -> _StepCache:
        """The cache of a step whose parameters the library took as they are (see _StepCache)."""
        slots, calls = [], []
        for bucket, (context, comm, params, _, keepalive) in made:
            for e, struct in zip(bucket, params):
                param, local = e["param"], e["local"]
                momentum = self.state[param]["momentum_buffer"] if e["grad"] is not None else None
                slots.append((weakref.ref(param), struct, local.data_ptr(), local.shape, param.dtype,
                              local.get_device(), _sharding_attributes(param), _placement(param),
                              None if momentum is None else weakref.ref(momentum),
                              None if momentum is None else local_tensor(momentum).data_ptr()))
            calls.append((context, comm, params, len(bucket), sorted({e["group"] for e in bucket}), keepalive))
        return _StepCache(_membership(self._muon_groups()), slots, calls)

    def _last_calls_again(self):
        """(device, [(context, comm, params, count, groups, keepalive)], gradients): the last
        step's library calls with this step's gradients (their local pieces) and group values,
        or None where anything else they were built from changed (see _StepCache)."""
        cache = self._step_cache
        if cache is None:
            return None
        muon_groups = self._muon_groups()
        if _membership(muon_groups) != cache.groups:
            return None
        params = [param for _, group in muon_groups for param in group["params"]
                  if not self._no_matrix(param, group)]
        gradients, grads, state = [], [], self.state
        for param, slot in zip(params, cache.slots):
            reference, struct, address, shape, dtype, device, attributes, placement, momentum, momentum_address = slot
            if reference() is not param:
                return None
            local = param
            if placement is not None:  # a DTensor (the reference says it is the same parameter)
                if not _same_placement(param, placement):
                    return None
                local = param.to_local()
            if (local.data_ptr() != address or local.shape != shape or param.dtype is not dtype
                    or not local.is_contiguous() or _sharding_attributes(param) != attributes):
                return None
            grad = param.grad
            if (grad is None) != (momentum is None):
                return None
            if grad is None:
                continue
            if is_dtensor(grad):
                if placement is None or not _same_placement(grad, placement, equal_mesh=True):
                    return None
                grad = grad.to_local()
            elif placement is not None:
                return None
            if (grad.dtype is not dtype or grad.shape != shape or grad.get_device() != device or grad.is_sparse
                    or not grad.is_contiguous()):
                return None
            buffer = (state.get(param) or {}).get("momentum_buffer")
            if buffer is None or buffer is not momentum() or local_tensor(buffer).data_ptr() != momentum_address:
                return None
            gradients.append((struct, grad.data_ptr() or None))
            grads.append(grad)
        calls = []
        for context, comm, params_array, count, indices, _ in cache.calls:
            keepalive = []  # what the groups point into (custom coefficients)
            try:
                groups = self._group_array(indices, context.device, keepalive)
            except (ValueError, TypeError):
                return None  # the full path raises it, on every rank
            calls.append((context, comm, params_array, count, groups, keepalive))
        for struct, address in gradients:
            struct.grad = address
        return cache.calls[0][0].device, calls, grads

    @torch.no_grad()
    def plan(self) -> Dict[str, Dict[str, Any]]:
        """How the next step() would orthogonalize each Muon parameter, without taking it: by
        parameter name (the one given with it, else "param_groups[i]['params'][j]"),
        {"algorithm": "local", "duplicated", "gram_allreduce", "gram_allreduce_redistributed" or
        "owner", "owner": the rank that orthogonalizes it under "owner" (else None; a rank of
        the group the parameter is stepped over),
        "gram_iteration": whether it runs Gram Newton-Schulz ((e)), "applied_twice": whether it
        runs (c)'s iteration (the summed Gram applied twice, on the distribution of
        "gram_allreduce" or "gram_allreduce_redistributed", or on the whole matrix where
        "local"), "group_size": the ranks of
        the process group it is stepped over (a DTensor's: those of its cut mesh dimensions), and
        "redistributed": the placements a DTensor parameter is redistributed to for the
        step (a Replicate() among them where it is gathered), or None}.
        It depends on which parameters have gradients, as the step does (one without takes no
        part in the owners). Like step(), the first call exchanges the shard sizes over the
        process group (every rank must call it) and creates the momentum buffers of the
        parameters with gradients."""
        entries, failure = self._collect()
        if not entries:
            return {}
        device = self._device(entries)
        names = {code: name for name, code in c.ALGORITHMS.items()}
        names.update(c.PLAN_NAMES)
        result = {}
        for bucket, arguments, _ in self._calls(entries, device, failure):
            context, comm, params, groups, keepalive = arguments
            algorithms = (ctypes.c_int * len(bucket))()
            owners = (ctypes.c_int * len(bucket))()
            gram = (ctypes.c_int * len(bucket))()
            twice = (ctypes.c_int * len(bucket))()
            c.check(c.lib.shardmuon_muon_plan(context.handle, comm.handle, params, len(bucket), groups,
                                              len(self.param_groups), algorithms, owners))
            c.check(c.lib.shardmuon_muon_plan_gram_iteration(context.handle, comm.handle, params,
                                                             len(bucket), groups, len(self.param_groups),
                                                             gram))
            c.check(c.lib.shardmuon_muon_plan_applied_twice(context.handle, comm.handle, params,
                                                            len(bucket), groups, len(self.param_groups),
                                                            twice))
            # Owners are ranks of the parameter's process group.
            for i, e in enumerate(bucket):
                result[e["name"]] = {"algorithm": names.get(algorithms[i], str(algorithms[i])),
                                     "owner": owners[i] if owners[i] >= 0 else None,
                                     "gram_iteration": bool(gram[i]),
                                     "applied_twice": bool(twice[i]),
                                     "group_size": group_size(e["process_group"]),
                                     "redistributed": e["regroup"]}
        return {e["name"].label: result[e["name"]] for e in entries}

    def _momentum(self, param, local, name) -> torch.Tensor:
        """A parameter's momentum buffer (created as zeros on its first step; a DTensor
        parameter's is a DTensor of the same placements, which a regrouped step redistributes),
        checked against the parameter and its local piece `local`: the library writes through
        the piece's pointer, so a loaded state of another shape must fail here."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        buffer = state["momentum_buffer"]
        if is_dtensor(param) and not (is_dtensor(buffer) and buffer.placements == param.placements):
            got = describe(buffer) if is_dtensor(buffer) else f"a {type(buffer).__name__}, not a DTensor"
            raise ValueError(f"{name}: its state's momentum_buffer must be a {param.dtype} DTensor with "
                             f"the parameter's {describe(param)}, got {got}")
        momentum = local_tensor(buffer)
        if (not torch.is_tensor(momentum) or momentum.shape != local.shape or momentum.dtype != local.dtype
                or momentum.device != local.device or not momentum.is_contiguous()):
            got = (f"{tuple(momentum.shape)} {momentum.dtype} on {momentum.device}, contiguous: "
                   f"{momentum.is_contiguous()}" if torch.is_tensor(momentum) else type(momentum).__name__)
            raise ValueError(f"{name}: its state's momentum_buffer must be a contiguous "
                             f"{tuple(local.shape)} {local.dtype} tensor on {local.device} (this rank's "
                             f"piece), got {got}")
        return buffer

    def _step_arguments(self, entries, runtime, process_group, group_indices):
        """The runtime and the C arrays of a step over `entries`, all over `process_group`, with
        the param groups `group_indices` filled in (and what must outlive the arrays)."""
        context, comm = runtime
        keepalive = []
        groups = self._group_array(group_indices, context.device, keepalive)
        return context, comm, self._param_structs(entries, context.device, process_group, keepalive), groups, keepalive

    def _group_array(self, group_indices, device, keepalive):
        """The C array of every param group, those of `group_indices` filled in from their
        values (checked), the others with any valid values (AdamW's, or another call's)."""
        groups = (c.MuonGroup * len(self.param_groups))()
        for index, group in enumerate(self.param_groups):
            if index in group_indices:
                groups[index] = self._group_struct(group, keepalive, device, index)
            else:
                c.check(c.lib.shardmuon_muon_group_default(ctypes.byref(groups[index])))
        return groups

    def _param_structs(self, entries, device, process_group, keepalive):
        """The C array of the parameters `entries`, split over `process_group` (the shard sizes
        of those not seen before are exchanged first); what it points to goes in keepalive."""
        self._gather_shard_sizes(entries, device, process_group)
        rank, ranks = group_rank(process_group), group_size(process_group)
        params = (c.MuonParam * len(entries))()
        for i, e in enumerate(entries):
            param, local, grad = e["param"], e["local"], e["grad"]
            p = params[i]
            p.param = local.data_ptr() or None
            p.dtype = _DTYPES[param.dtype]
            p.group = e["group"]
            if grad is None:
                p.no_grad = 1
            else:
                p.grad = grad.data_ptr() or None
                if "momentum" in e:  # a regrouped parameter's copy
                    momentum = e["momentum"]
                else:
                    momentum = local_tensor(self._momentum(param, local, e["name"]))
                p.momentum = momentum.data_ptr() or None
            rows, cols = e["shape"]
            p.row_blocks = e["row_blocks"]
            if e["dim"] is None or ranks == 1:
                if local.numel() != rows * cols:  # a flat shard on one rank is the whole matrix
                    raise ValueError(f"{e['name']}: holds {local.numel()} elements, not the "
                                     f"{rows} x {cols} of its muon_shape")
                p.layout = c.Layout(rows, cols, c.REPLICATED, 1, None)
            else:
                sizes = self._shard_sizes[param]
                if sizes[rank] != e["extent"]:
                    raise ValueError(f"{e['name']}: its shard changed size since the first step")
                if is_dtensor(param) and sum(sizes) != e["shape"][e["dim"]]:
                    raise ValueError(f"{e['name']}: its ranks' pieces are {sizes} along the split, "
                                     f"{sum(sizes)} in all, not its global {e['shape'][e['dim']]}")
                array = (ctypes.c_int64 * len(sizes))(*sizes)
                keepalive.append(array)
                if e["dim"] == "flat":
                    if sum(sizes) != rows * cols:
                        raise ValueError(f"{e['name']}: the ranks' flat shards hold {sum(sizes)} "
                                         f"elements in all, not the {rows} x {cols} of its muon_shape")
                    p.layout = c.Layout(rows, cols, c.SHARDED_FLAT, len(sizes), array)
                elif e["dim"] == 0:
                    p.layout = c.Layout(sum(sizes), cols, c.SHARDED_DIM0, len(sizes), array)
                else:
                    p.layout = c.Layout(rows, sum(sizes), c.SHARDED_DIM1, len(sizes), array)
        return params


class MuonWithAdamW(Muon):
    """Muon for the groups marked ``use_muon=True`` and torch.optim.AdamW for the others
    (embeddings, norms, biases, the output head), in one optimizer: one ``step``,
    ``zero_grad``, ``state_dict`` and LR scheduler for both. AdamW groups take ``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``amsgrad`` and ``maximize`` (defaults: adamw_betas,
    adamw_eps, 0.0, False, False): an AdamW group's ``eps`` is AdamW's, a Muon group's Muon's.
    A scheduler that cycles momentum (OneCycleLR's ``cycle_momentum``, CyclicLR's) sets the
    Muon groups' ``momentum`` only: this optimizer's defaults have no ``betas``, so it never
    writes the AdamW groups' beta1.
    ``muon_param_groups(model)`` builds such groups from a model.

    Under ``nonfinite`` "skip" or "raise", a NaN or Inf in any gradient, Muon's or AdamW's,
    skips both (or raises before either writes): the AdamW gradients are checked on the GPU
    and the result passed to the Muon step as its step flag (shardmuon_context_set_step_flag),
    which says after it whether the step was skipped, on every rank of its process group.
    On CUDA, AdamW is torch's fused AdamW, whose kernel reads that verdict on the GPU (as it
    reads a loss scaler's found_inf): nothing waits. Elsewhere (CPU tensors, DTensor
    parameters in the AdamW groups, a PyTorch without fused AdamW) reading the verdict waits
    for the Muon step, once a step; "proceed" checks nothing. Under a GradScaler (see Muon)
    its found_inf, which covers the AdamW gradients too, takes the place of their check."""

    def __init__(self, param_groups: List[Dict[str, Any]], *, adamw_betas=(0.9, 0.95),
                 adamw_eps: float = 1e-8, **muon_kwargs):
        self._adamw_defaults = {"betas": adamw_betas, "eps": adamw_eps, "weight_decay": 0.0, "amsgrad": False,
                                "maximize": False}
        param_groups = [self._with_adamw_defaults(group, index) for index, group in enumerate(param_groups)]
        super().__init__(param_groups, **muon_kwargs)
        # torch.optim.AdamW refuses an empty list: without AdamW groups it is made when the
        # first one is added.
        adamw_groups = [self._adamw_group(g) for g in self.param_groups if not g["use_muon"]]
        self._adam = self._make_adamw(adamw_groups) if adamw_groups else None
        self._link_adam()

    def _with_adamw_defaults(self, group: Dict[str, Any], index: int) -> Dict[str, Any]:
        if not isinstance(group.get("use_muon"), bool):
            raise ValueError(f"MuonWithAdamW: param_groups[{index}] needs use_muon=True or False, got "
                             f"{group.get('use_muon', 'none')!r}")
        group = dict(group)
        if not group["use_muon"]:
            for key, value in self._adamw_defaults.items():
                group.setdefault(key, value)
            _check_adamw_hyperparameters(group, f"MuonWithAdamW param_groups[{index}]")
        return group

    @staticmethod
    def _make_adamw(groups):
        """torch.optim.AdamW over the groups: fused when every parameter is a CUDA tensor (not
        a DTensor) and this PyTorch has a fused AdamW, whose kernel skips on a device tensor
        (found_inf, as loss scalers use it), so that the step's verdict needs no waiting."""
        params = [p for g in groups for p in g["params"]]
        if all(p.is_cuda and not is_dtensor(p) for p in params):
            try:
                return torch.optim.AdamW(groups, fused=True)
            except (RuntimeError, TypeError, ValueError):  # no fused AdamW here, or not for these
                pass
        return torch.optim.AdamW(groups)

    @staticmethod
    def _adamw_group(group: Dict[str, Any]) -> Dict[str, Any]:
        return {"params": group["params"], "lr": group["lr"], "betas": group["betas"],
                "eps": group["eps"], "weight_decay": group["weight_decay"],
                **{key: group[key] for key in _ADAMW_SWITCHES}}

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Muon's; a group added after construction with use_muon=False joins AdamW too."""
        if not hasattr(self, "_adam"):  # from __init__, which links AdamW's groups itself
            super().add_param_group(param_group)
            return
        super().add_param_group(self._with_adamw_defaults(param_group, len(self.param_groups)))
        if not self.param_groups[-1]["use_muon"]:
            # Made anew over all AdamW groups (the state is ours, see _link_adam), so that it is
            # fused only while every parameter can be: a fused AdamW would take a CPU or
            # DTensor parameter's group and fail at its step.
            self._adam = self._make_adamw([self._adamw_group(g) for g in self.param_groups if not g["use_muon"]])
        self._link_adam()

    def _muon_groups(self):
        return [(i, g) for i, g in enumerate(self.param_groups) if g["use_muon"]]

    def _link_adam(self):
        """AdamW shares this optimizer's state, and its groups track ours (lr from schedulers)."""
        self._adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        if self._adam is not None:
            self._adam.state = self.state
            if any(g.get("fused") for g in self._adam.param_groups):
                # A loaded state keeps a step count where it was saved or mapped to (on the
                # CPU, by foreach AdamW or torch.load(map_location="cpu")); fused AdamW wants
                # it on its parameter's device, in float32.
                for group in self._adam.param_groups:
                    for p in group["params"]:
                        step = self.state.get(p, {}).get("step")
                        if torch.is_tensor(step) and step.device != p.device:
                            self.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)

    def _check_other_steps(self):
        # torch.optim.AdamW raises on a sparse gradient (nn.Embedding(sparse=True)) only when it
        # steps, after the Muon groups have been written: found here first.
        grads = []
        for index, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                for position, p in enumerate(group["params"]):
                    if p.grad is not None and p.grad.is_sparse:
                        raise ValueError(f"MuonWithAdamW: {self._name(p, index, position)} has a sparse "
                                         "gradient, which torch.optim.AdamW does not take")
                    if p.grad is not None:
                        grads.append(local_tensor(p.grad))
        # Whether the AdamW gradients hold a NaN or Inf joins the Muon step's flag (see the
        # class's note), unless nothing is checked, or a loss scaler's found_inf, which covers
        # every gradient of this optimizer, is there already.
        if grads and self._step_policy != "proceed" and not self._flag_inputs:
            self._flag_inputs.append(_any_nonfinite(grads, grads[0].device))

    def _other_steps(self):
        if self._adam is None:
            return
        for ours, theirs in zip(self._adam_groups, self._adam.param_groups):
            theirs["lr"] = ours["lr"]
            theirs["weight_decay"] = ours["weight_decay"]
            theirs["betas"] = ours["betas"]
            theirs["eps"] = ours["eps"]
            for key in _ADAMW_SWITCHES:
                theirs[key] = ours[key]
        fused = any(g.get("fused") for g in self._adam.param_groups)
        if self._verdict is None:  # "proceed", or no gradient to check
            self._adam.found_inf = None
            self._adam.step()
            return
        # The verdict as a 0-dimensional 1.0 or 0.0 on the AdamW parameters' device, the
        # found_inf the fused kernel takes.
        device = next((p.device for g in self._adam.param_groups for p in g["params"]), self._verdict.device)
        skipped = (self._verdict.reshape(-1)[0] != 0).to(device=device, dtype=torch.float32)
        if not self._called_library:  # no Muon call counted it
            counted = self._steps_skipped_here
            self._steps_skipped_here = skipped.clone() if counted is None else counted + skipped
            if self._step_policy == "raise" and skipped.item() != 0.0:
                raise c.ShardmuonError(c.ERROR_NON_FINITE, "SHARDMUON_ERROR_NON_FINITE: a gradient of the "
                                       "AdamW groups was not finite (NaN or Inf); the step was skipped "
                                       "and nothing was written")
        if fused:
            self._adam.found_inf = skipped  # the fused kernel skips on the device
            self._adam.step()
        elif skipped.item() == 0.0:  # waits for the Muon step
            self._adam.step()

    def load_state_dict(self, state_dict):
        # A group saved as the other optimizer (Muon for AdamW) is refused: AdamW's state for
        # it would be missing, and its step would fail after the Muon groups' had written.
        saved = state_dict["param_groups"]
        if len(saved) == len(self.param_groups):
            for index, (group, ours) in enumerate(zip(saved, self.param_groups)):
                if group.get("use_muon") != ours["use_muon"]:
                    raise ValueError(f"MuonWithAdamW.load_state_dict: param_groups[{index}] was saved with "
                                     f"use_muon={group.get('use_muon')!r}, but here it has "
                                     f"use_muon={ours['use_muon']}")
        # Saved before the forty-fourth session, an AdamW group lacked amsgrad and maximize
        # (False: AdamW's defaults); before the forty-first, it kept AdamW's eps as
        # "adamw_eps" (and Muon's default under "eps", which it ignored).
        groups = []
        for group in saved:
            if not group.get("use_muon", True):
                group = {**{key: False for key in _ADAMW_SWITCHES}, **group}
                if "adamw_eps" in group:
                    group["eps"] = group.pop("adamw_eps")
            groups.append(group)
        super().load_state_dict({**state_dict, "param_groups": groups})
        self._link_adam()


# torch.optim.Muon's adjust_lr_fn as Muon's (scale_mode, extra_scale_factor): "original" (its
# default, None) scales the update by sqrt(max(1, rows / cols)), "match_rms_adamw" by
# 0.2 sqrt(max(rows, cols)).
_TORCH_ADJUST_LR = {None: ("shape_scaling", 1.0), "original": ("shape_scaling", 1.0),
                    "match_rms_adamw": ("spectral", 0.2)}
# Muon's names for what TorchMuon takes under torch.optim.Muon's (ns_coefficients, ns_steps,
# adjust_lr_fn): derived from those, never given.
_TORCH_DERIVED = ("coefficient_type", "custom_coefficients", "num_ns_steps", "scale_mode", "extra_scale_factor")


class TorchMuon(Muon):
    """Muon with torch.optim.Muon's arguments and defaults (PyTorch 2.9 and later), for code
    written for it: ``TorchMuon(params, lr=1e-3, weight_decay=0.1, momentum=0.95,
    nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
    adjust_lr_fn=None)``, and the same step: momentum as lerp, decoupled weight decay,
    ``ns_steps`` iterations of the one (a, b, c), the update scaled by ``adjust_lr_fn``
    (None or "original": sqrt(max(1, rows / cols)); "match_rms_adamw": 0.2 sqrt(max(rows,
    cols))), and the iteration in bf16 whatever the weights' dtype, as torch.optim.Muon runs
    it (``ns_dtype=torch.bfloat16``; pass None for the weights' own dtype). Muon's other
    keywords (process_group, algorithm, ns_dtype, ...) may be added; its names for what these
    arguments set (coefficient_type, custom_coefficients, num_ns_steps, scale_mode,
    extra_scale_factor) are refused.

    The groups hold torch.optim.Muon's names (``group["ns_steps"]`` and the others are read at
    every step, like the learning rate), and the state is its ``momentum_buffer``: a
    torch.optim.Muon state dict loads (the keys its groups lack come from this optimizer's
    defaults), and this optimizer's loads into torch.optim.Muon. The update is divided by
    max(its norm, eps), as torch.optim.Muon's ``clamp(min=eps)`` does. And it takes what Muon
    takes beyond 2D weights on one device: shards (``partition_dim``, DTensors), 3D expert stacks, fused
    weights (``muon_row_blocks``)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: Sequence[float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: Optional[str] = None, *,
                 ns_dtype: Optional[torch.dtype] = torch.bfloat16, **muon_kwargs):
        derived = sorted(set(muon_kwargs) & set(_TORCH_DERIVED))
        if derived:
            raise TypeError(f"TorchMuon: {', '.join(derived)} come from ns_coefficients, ns_steps and "
                            "adjust_lr_fn, as in torch.optim.Muon")
        self._torch_defaults = {"ns_coefficients": ns_coefficients, "ns_steps": ns_steps,
                                "adjust_lr_fn": adjust_lr_fn}
        self._hyperparameters(self._torch_defaults, "TorchMuon")  # checked before any group takes them
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         eps=eps, ns_dtype=ns_dtype, **muon_kwargs)
        for key in _TORCH_DERIVED:
            del self.defaults[key]
        self.defaults.update(self._torch_defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Muon's, under torch.optim.Muon's names (ns_coefficients, ns_steps, adjust_lr_fn:
        the optimizer's where the group gives none)."""
        derived = sorted(set(param_group) & set(_TORCH_DERIVED))
        if derived:
            raise ValueError(f"Muon param_groups[{len(self.param_groups)}]: {', '.join(derived)} come "
                             "from ns_coefficients, ns_steps and adjust_lr_fn, as in torch.optim.Muon")
        for key, value in self._torch_defaults.items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        for key in _TORCH_DERIVED:  # filled in from Muon's defaults, and derived at each step
            self.param_groups[-1].pop(key, None)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Muon's; a group saved without some of this optimizer's keys (by torch.optim.Muon)
        takes them from its defaults (never Muon's names: _check_saved_groups refuses those)."""
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [{**self.defaults, **group} for group in state_dict["param_groups"]]
        super().load_state_dict(state_dict)

    def _check_saved_groups(self, groups: List[Dict[str, Any]]) -> None:
        for index, group in enumerate(groups):
            derived = sorted(set(group) & set(_TORCH_DERIVED))
            if derived:
                raise ValueError(f"TorchMuon: the state dict's param_groups[{index}] has {', '.join(derived)}: "
                                 "it was saved by Muon, whose groups name the iteration otherwise")

    def _hyperparameters(self, group: Dict[str, Any], where: str) -> Dict[str, Any]:
        adjust_lr_fn, steps, coefficients = group["adjust_lr_fn"], group["ns_steps"], group["ns_coefficients"]
        if adjust_lr_fn not in _TORCH_ADJUST_LR:
            raise ValueError(f"{where}: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', "
                             f"got {adjust_lr_fn!r}")
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 1 <= steps <= c.MAX_NS_ITERATIONS:
            raise ValueError(f"{where}: ns_steps must be an int in [1, {c.MAX_NS_ITERATIONS}], got {steps!r}")
        try:
            triple = tuple(float(x) for x in coefficients)
        except (TypeError, ValueError):
            triple = ()
        if len(triple) != 3:
            raise ValueError(f"{where}: ns_coefficients must be three numbers (a, b, c), got {coefficients!r}")
        scale_mode, extra_scale_factor = _TORCH_ADJUST_LR[adjust_lr_fn]
        return {**group, "coefficient_type": "custom", "custom_coefficients": [triple] * int(steps),
                "num_ns_steps": int(steps), "scale_mode": scale_mode, "extra_scale_factor": extra_scale_factor}


def muon_param_groups(model: torch.nn.Module, *, muon_lr: float, adamw_lr: float,
                      adamw_weight_decay: float = 0.0,
                      exclude: Sequence[str] = ("lm_head", "output_head", "wte", "wpe")):
    """Groups for MuonWithAdamW: the weight matrices go to Muon (2D weights, 3D expert stacks
    and 1D tensors marked as flat shards of a matrix), except embeddings (nn.Embedding modules)
    and parameters whose name contains one of ``exclude`` (the output head), which Muon users
    train with AdamW; everything else (norms, biases) goes to AdamW. So do convolution
    kernels (nn.Conv1d/2d/3d and their transposes): a Conv1d's (out, in, k) weight is one
    matrix, not a stack of ``out`` experts, and Muon here takes no 4D or 5D one."""
    not_muon = (torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)
    other_params = {id(p) for module in model.modules() if isinstance(module, not_muon)
                    for p in module.parameters(recurse=False)}
    muon, adam = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim in (2, 3) or getattr(param, "partition_dim", None) == "flat"
        if matrix and id(param) not in other_params and not any(word in name for word in exclude):
            muon.append((name, param))
        else:
            adam.append(param)
    return [{"params": muon, "use_muon": True, "lr": muon_lr},
            {"params": adam, "use_muon": False, "lr": adamw_lr, "weight_decay": adamw_weight_decay}]


def load_resharded_state_dict(optimizer: Muon, state_dicts: Sequence[Dict[str, Any]]):
    """Loads a state saved under another tensor-parallel size: ``state_dicts`` are the state
    dicts that every rank of the old group saved, in rank order; this rank keeps its part.

    Each state tensor of a sharded parameter (Muon's momentum, AdamW's moments of a sharded
    bias) is assembled from the old ranks' pieces along the parameter's partition dim and cut to
    this rank's shard (uneven shards included); state of replicated parameters comes from old
    rank 0. The parameters must say how they are split (a partition_dim attribute, or for
    Muon groups the group option; AdamW groups' parameters without the attribute are
    replicated), also when the new group has one rank. Every rank of the new group calls this."""
    if not state_dicts:
        raise ValueError("load_resharded_state_dict: no state dicts given")
    entries = []
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            if is_dtensor(param):
                raise ValueError(f"load_resharded_state_dict: {optimizer._name(param, group_index, index)} "
                                 "is a DTensor: its optimizer state is DTensors too, which "
                                 "torch.distributed.checkpoint saves and reshards")
            attribute = getattr(param, "partition_dim", None)
            if getattr(param, "tensor_model_parallel", None) is False:
                attribute = -1
            # A group's partition_dim is Muon's option: AdamW groups' state follows only the
            # parameters' own attributes (replicated without one), as their step does.
            group_dim = group.get("partition_dim") if group.get("use_muon", True) else None
            dim = attribute if attribute is not None else group_dim
            # dim is the tensor's (2 for a 3D parameter's columns; a flat shard is a 1D tensor,
            # cut along its only dim); its extent there is the shard size the step records.
            dim = None if dim in (None, -1) else 0 if dim == "flat" else dim
            entries.append({"param": param, "dim": dim, "shape": tuple(param.shape),
                            "extent": None if dim is None else param.shape[dim]})
    device = next((e["param"].device for e in entries), torch.device("cpu"))
    optimizer._gather_shard_sizes([e for e in entries if e["dim"] is not None], device,
                                  optimizer.process_group)
    rank = group_rank(optimizer.process_group)
    result = {"state": {}, "param_groups": state_dicts[0]["param_groups"]}
    for index, entry in enumerate(entries):
        old = [sd["state"].get(index) for sd in state_dicts]
        if old[0] is None:
            continue
        param, dim = entry["param"], entry["dim"]
        if dim is None:
            result["state"][index] = old[0]
            continue
        sizes = optimizer._shard_sizes[param]
        start = sum(sizes[:rank])
        state = {}
        for key, value in old[0].items():
            if torch.is_tensor(value) and value.ndim == param.ndim and value.ndim > 0:
                whole = torch.cat([sd[key] for sd in old], dim=dim)
                state[key] = whole.narrow(dim, start, sizes[rank]).clone()
            else:
                state[key] = value
        result["state"][index] = state
    optimizer.load_state_dict(result)


class NewtonSchulz:
    """Muon's orthogonalization on its own: ``ns(shard, shape, partition_dim, shard_sizes)``
    replaces, in place, this rank's shard of a matrix of ``shape`` with its shard of the
    Newton-Schulz result of the whole matrix (the gathered matrix, normalized by its global
    Frobenius norm, then ``ns_steps`` iterations). Collective over ``process_group`` when the
    matrix is sharded (``partition_dim`` 0 or 1, ``shard_sizes`` every rank's extent along it,
    default: even); ``partition_dim=None`` means every rank holds the whole matrix. The
    normalization is part of the call, as in torch.optim.Muon's iteration; TransformerEngine's
    ``newton_schulz`` iterates on its input as given (its optimizer normalizes first), so the
    two agree on inputs already of unit Frobenius norm.

    ``ns(dtensor)`` takes a 2D DTensor instead: its placements give the split and the process
    group (its cut mesh dimensions'), and each call exchanges the pieces' extents over that
    group. The input is not checked: a NaN or Inf anywhere makes every element of the result
    NaN (Muon's steps check their gradients, see ``nonfinite``).
    """

    def __init__(self, process_group=None, *, ns_steps: int = 5, coefficient_type: str = "quintic",
                 eps: float = 1e-7, algorithm: str = "auto"):
        self.process_group = checked_group(process_group, "NewtonSchulz")
        self._options = c.NsOptions()
        c.check(c.lib.shardmuon_ns_options_default(ctypes.byref(self._options)))
        if coefficient_type not in c.SCHEDULES or coefficient_type == "custom":
            raise ValueError(f"shardmuon: coefficient_type {coefficient_type!r} is not one of "
                             f"{sorted(set(c.SCHEDULES) - {'custom'})}")
        if algorithm not in c.ALGORITHMS:
            raise ValueError(f"shardmuon: algorithm {algorithm!r} is not one of {sorted(c.ALGORITHMS)}")
        self._options.num_iterations = int(ns_steps)
        self._options.schedule = c.SCHEDULES[coefficient_type]
        self._options.eps = float(eps)
        self._options.algorithm = c.ALGORITHMS[algorithm]
        self._runtimes = Runtimes()

    def coefficients(self):
        """The (a, b, c) of every iteration."""
        result = []
        for k in range(self._options.num_iterations):
            abc = [ctypes.c_double() for _ in range(3)]
            c.check(c.lib.shardmuon_schedule_coefficients(
                self._options.schedule, k, ctypes.byref(self._options), *[ctypes.byref(x) for x in abc]))
            result.append(tuple(x.value for x in abc))
        return result

    def _layout(self, shape, partition_dim, shard_sizes, keepalive, process_group):
        rows, cols = (int(x) for x in shape)
        size = group_size(process_group)
        if partition_dim not in (0, 1, None, "flat"):
            raise ValueError(f"shardmuon: partition_dim must be 0, 1, \"flat\" or None, got "
                             f"{partition_dim!r}")
        extent = None if partition_dim is None else rows * cols if partition_dim == "flat" else (
            rows, cols)[partition_dim]
        if partition_dim is None or size == 1:
            # One rank holds it all: shard_sizes, where given, must say so.
            if extent is not None and shard_sizes is not None and [int(x) for x in shard_sizes] != [extent]:
                raise ValueError(f"shardmuon: shard_sizes must be [{extent}] on a group of one rank, got "
                                 f"{list(shard_sizes)!r}")
            return c.Layout(rows, cols, c.REPLICATED, 1, None)
        if shard_sizes is None:
            shard_sizes = [extent // size + (1 if r < extent % size else 0) for r in range(size)]
        array = (ctypes.c_int64 * len(shard_sizes))(*[int(x) for x in shard_sizes])
        keepalive.append(array)
        kind = {0: c.SHARDED_DIM0, 1: c.SHARDED_DIM1, "flat": c.SHARDED_FLAT}[partition_dim]
        return c.Layout(rows, cols, kind, len(shard_sizes), array)

    def _ask_planner(self, function, result, shape, partition_dim, shard_sizes):
        """Calls one of the library's planner queries (function(layout, comm_size, options,
        &result)) for a call with these arguments, and returns result's value."""
        keepalive = []
        layout = self._layout(shape, partition_dim, shard_sizes, keepalive, self.process_group)
        c.check(function(ctypes.byref(layout), group_size(self.process_group), ctypes.byref(self._options),
                         ctypes.byref(result)))
        return result.value

    def plan(self, shape, partition_dim=None, shard_sizes=None) -> str:
        """The algorithm a call with these arguments runs (no communication)."""
        chosen = self._ask_planner(c.lib.shardmuon_ns_plan, ctypes.c_int(), shape, partition_dim, shard_sizes)
        return c.PLAN_NAMES.get(chosen, str(chosen))

    def uses_gram_iteration(self, shape, partition_dim=None, shard_sizes=None) -> bool:
        """Whether that call runs (e)'s Gram iteration on the distribution plan() names (always
        under algorithm="gram_newton_schulz"; under "auto" where the cost model finds it
        cheaper) rather than the standard iteration (no communication)."""
        return bool(self._ask_planner(c.lib.shardmuon_ns_plan_gram_iteration, ctypes.c_int(), shape,
                                      partition_dim, shard_sizes))

    def uses_applied_twice(self, shape, partition_dim=None, shard_sizes=None) -> bool:
        """Whether that call runs (c)'s iteration, the summed Gram applied twice (always under
        algorithm="gram_applied_twice"; under "auto" where the cost model finds it cheaper on a
        Gram summed over the process group: large square matrices over 2 ranks or more)
        (no communication)."""
        return bool(self._ask_planner(c.lib.shardmuon_ns_plan_applied_twice, ctypes.c_int(), shape,
                                      partition_dim, shard_sizes))

    def estimate_seconds(self, shape, partition_dim=None, shard_sizes=None) -> float:
        """The planner's cost-model estimate for that call (bf16 on H200-class GPUs)."""
        return self._ask_planner(c.lib.shardmuon_ns_estimate, ctypes.c_double(), shape, partition_dim,
                                 shard_sizes)

    @torch.no_grad()
    def __call__(self, shard: torch.Tensor, shape=None, partition_dim=None, shard_sizes=None) -> torch.Tensor:
        if is_dtensor(shard):
            return self._orthogonalize_dtensor(shard, shape, partition_dim, shard_sizes)
        if shape is None:
            raise ValueError("shardmuon: give the whole matrix's shape (rows, cols)")
        return self._orthogonalize(shard, shape, partition_dim, shard_sizes, self.process_group)

    def _orthogonalize_dtensor(self, dtensor, shape, partition_dim, shard_sizes):
        if dtensor.ndim != 2:
            raise ValueError(f"shardmuon: NewtonSchulz takes a 2D DTensor, got shape {tuple(dtensor.shape)}")
        if partition_dim is not None or shard_sizes is not None:
            raise ValueError("shardmuon: a DTensor's placements give its split: leave partition_dim "
                             f"and shard_sizes out (got {partition_dim!r}, {shard_sizes!r})")
        if shape is not None and tuple(shape) != tuple(dtensor.shape):
            raise ValueError(f"shardmuon: shape {tuple(shape)} is not the DTensor's {tuple(dtensor.shape)}")
        how = sharding(dtensor, "shardmuon: NewtonSchulz's DTensor")
        process_group, dim = how.process_group, how.dim
        # A split the library cannot take as it is is redistributed first (see _dtensor.sharding).
        piece = dtensor if how.regroup is None else redistributed(dtensor, how.regroup)
        local = piece.to_local()
        sizes = None
        if dim is not None:
            sizes = [row[0] for row in _all_gather_ints([local.shape[dim]], process_group, local.device)]
            if sum(sizes) != dtensor.shape[dim]:
                raise ValueError(f"shardmuon: the DTensor's pieces are {sizes} along dim {dim}, "
                                 f"{sum(sizes)} in all, not its global {dtensor.shape[dim]}")
        whole_shape = tuple(dtensor.shape) if dim is not None else tuple(local.shape)
        self._orthogonalize(local, whole_shape, dim, sizes, process_group)
        if piece is not dtensor:
            write_into(dtensor, piece)
        return dtensor

    def _orthogonalize(self, shard, shape, partition_dim, shard_sizes, process_group):
        if shard.dtype not in _DTYPES or not shard.is_contiguous():
            raise ValueError(f"shardmuon: the shard must be a contiguous float32, bfloat16 or float64 "
                             f"tensor, got {shard.dtype} (contiguous: {shard.is_contiguous()})")
        context, comm = self._runtimes.get(shard.device, process_group)
        keepalive = []
        layout = self._layout(shape, partition_dim, shard_sizes, keepalive, process_group)
        # The library sees a pointer only: the shard's extent is checked here. A flat shard is
        # 1D, also where one rank holds every element.
        expected = [layout.rows, layout.cols]
        if partition_dim == "flat" and layout.partition == c.REPLICATED:
            expected = [layout.rows * layout.cols]
        if layout.partition != c.REPLICATED:
            dim = 0 if layout.partition == c.SHARDED_DIM0 else 1
            if layout.num_shards != group_size(process_group):
                raise ValueError(f"shardmuon: shard_sizes has {layout.num_shards} entries for a group of "
                                 f"{group_size(process_group)} ranks")
            expected[dim] = layout.shard_sizes[group_rank(process_group)]
            if layout.partition == c.SHARDED_FLAT:  # a range of the row-major elements
                expected = [layout.shard_sizes[group_rank(process_group)]]
        if list(shard.shape) != expected:
            raise ValueError(f"shardmuon: this rank's shard of the {layout.rows} x {layout.cols} matrix "
                             f"must be {' x '.join(map(str, expected))}, got {tuple(shard.shape)}")
        stream = torch.cuda.current_stream(shard.device).cuda_stream if shard.is_cuda else None
        status = c.lib.shardmuon_newton_schulz(
            context.handle, comm.handle, ctypes.c_void_p(shard.data_ptr() if shard.numel() else None),
            _DTYPES[shard.dtype], ctypes.byref(layout), ctypes.byref(self._options), ctypes.c_void_p(stream))
        comm.raise_callback_error()
        c.check(status)
        return shard
