"""ctypes bindings of include/shardmuon/shardmuon.h.

The library is found through $SHARDMUON_LIBRARY, next to this package, in the source tree's
build/ folder, or on the loader's path. On load, every struct below is checked field by field
against the library's own layout (shardmuon_abi_layout), so a header change that these
bindings missed fails loudly instead of corrupting memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

# Status, dtype, backend, partition and mode codes (the header's enums).
SUCCESS = 0
FLOAT32, BFLOAT16, FLOAT64 = 0, 1, 2
BACKEND_CPU, BACKEND_CUDA = 0, 1
REPLICATED, SHARDED_DIM0, SHARDED_DIM1, SHARDED_FLAT = 0, 1, 2, 3
SCHEDULES = {"simple": 0, "quintic": 1, "polar_express": 2, "cans": 3, "aol": 4, "custom": 5}
ALGORITHMS = {"auto": 0, "duplicated": 1, "gram_allreduce": 2, "owner": 3, "gram_newton_schulz": 4,
              "gram_applied_twice": 5}
# What shardmuon_ns_plan reports besides ALGORITHMS' codes.
PLAN_NAMES = {1: "duplicated", 2: "gram_allreduce", 100: "local", 101: "gram_allreduce_redistributed"}
WEIGHT_DECAY_MODES = {"decoupled": 0, "l2": 1, "independent": 2, "none": 3}
SCALE_MODES = {"spectral": 0, "shape_scaling": 1, "unit_rms_norm": 2, "none": 3}
# shardmuon_ns_storage: the dtype a group's updates are orthogonalized in (None: the parameter's).
NS_STORAGES = {None: 0, "bfloat16": 1, "float32": 2}
# shardmuon_nonfinite_policy: what a step does with a NaN or Inf (the header's comments).
NONFINITE_POLICIES = {"skip": 0, "raise": 1, "proceed": 2}
ERROR_NON_FINITE = 13
MAX_NS_ITERATIONS = 1000  # SHARDMUON_MAX_NS_ITERATIONS


class Layout(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("partition", ctypes.c_int),
        ("num_shards", ctypes.c_int),
        ("shard_sizes", ctypes.POINTER(ctypes.c_int64)),
    ]


class NsOptions(ctypes.Structure):
    _fields_ = [
        ("num_iterations", ctypes.c_int),
        ("schedule", ctypes.c_int),
        ("custom_coefficients", ctypes.POINTER(ctypes.c_double)),
        ("num_custom_coefficients", ctypes.c_int),
        ("eps", ctypes.c_double),
        ("algorithm", ctypes.c_int),
    ]


class MuonGroup(ctypes.Structure):
    _fields_ = [
        ("lr", ctypes.c_double),
        ("momentum", ctypes.c_double),
        ("nesterov", ctypes.c_int),
        ("weight_decay", ctypes.c_double),
        ("weight_decay_mode", ctypes.c_int),
        ("scale_mode", ctypes.c_int),
        ("extra_scale_factor", ctypes.c_double),
        ("ns", NsOptions),
        ("lr_on_device", ctypes.c_void_p),
        ("ns_storage", ctypes.c_int),
    ]


class MuonParam(ctypes.Structure):
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("momentum", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("layout", Layout),
        ("group", ctypes.c_int),
        ("no_grad", ctypes.c_int),
        ("row_blocks", ctypes.c_int64),
    ]


ALL_REDUCE_SUM = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
)
ALL_GATHER = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
)
SIZES = ctypes.POINTER(ctypes.c_size_t)
ALL_TO_ALL = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    SIZES,
    SIZES,
    ctypes.c_void_p,
    SIZES,
    SIZES,
    ctypes.c_void_p,
)
AGREE_MAX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int)


class CommCallbacks(ctypes.Structure):
    _fields_ = [
        ("user_data", ctypes.c_void_p),
        ("rank", ctypes.c_int),
        ("size", ctypes.c_int),
        ("all_reduce_sum", ALL_REDUCE_SUM),
        ("all_gather", ALL_GATHER),
        ("all_to_all", ALL_TO_ALL),
        ("agree_max", AGREE_MAX),
    ]


_STRUCTS = {
    "shardmuon_layout": Layout,
    "shardmuon_ns_options": NsOptions,
    "shardmuon_muon_group": MuonGroup,
    "shardmuon_muon_param": MuonParam,
    "shardmuon_comm_callbacks": CommCallbacks,
}


class ShardmuonError(RuntimeError):
    """A failed library call: the status name and the library's message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _candidates():
    if os.environ.get("SHARDMUON_LIBRARY"):
        yield Path(os.environ["SHARDMUON_LIBRARY"])
    here = Path(__file__).resolve().parent
    yield here / "libshardmuon.so"
    yield here.parent.parent / "build" / "libshardmuon.so"
    found = ctypes.util.find_library("shardmuon")
    if found:
        yield Path(found)


def _load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.is_absolute() and not path.exists():
            continue
        try:
            return ctypes.CDLL(str(path)), str(path)
        except OSError as error:
            tried[-1] += f" ({error})"
    raise ImportError(
        "shardmuon: cannot find libshardmuon.so; build it (bash scripts/build.sh) or set "
        "SHARDMUON_LIBRARY. Tried: " + "; ".join(tried)
    )


lib, library_path = _load()

_c_status = ctypes.c_int
_signatures = {
    "shardmuon_last_error": (ctypes.c_char_p, []),
    "shardmuon_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "shardmuon_version": (_c_status, [ctypes.POINTER(ctypes.c_int)] * 3),
    "shardmuon_build_info": (_c_status, [ctypes.POINTER(ctypes.c_int)] * 3),
    "shardmuon_abi_layout": (
        _c_status,
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
    ),
    "shardmuon_ns_options_default": (_c_status, [ctypes.POINTER(NsOptions)]),
    "shardmuon_muon_group_default": (_c_status, [ctypes.POINTER(MuonGroup)]),
    "shardmuon_context_create": (_c_status, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]),
    "shardmuon_context_destroy": (_c_status, [ctypes.c_void_p]),
    "shardmuon_context_set_ns_batch_bytes": (_c_status, [ctypes.c_void_p, ctypes.c_size_t]),
    "shardmuon_context_set_nonfinite_policy": (_c_status, [ctypes.c_void_p, ctypes.c_int]),
    "shardmuon_context_set_step_flag": (_c_status, [ctypes.c_void_p, ctypes.c_void_p]),
    "shardmuon_context_reduce_step_flag": (_c_status, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]),
    "shardmuon_context_nonfinite_counts": (
        _c_status, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]),
    "shardmuon_context_workspace_bytes": (_c_status, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
    "shardmuon_comm_create_self": (_c_status, [ctypes.POINTER(ctypes.c_void_p)]),
    "shardmuon_comm_create_nccl": (_c_status, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
    "shardmuon_comm_create_callbacks": (
        _c_status,
        [ctypes.POINTER(CommCallbacks), ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
    ),
    "shardmuon_comm_destroy": (_c_status, [ctypes.c_void_p]),
    "shardmuon_newton_schulz": (
        _c_status,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(Layout),
         ctypes.POINTER(NsOptions), ctypes.c_void_p],
    ),
    "shardmuon_ns_plan": (
        _c_status,
        [ctypes.POINTER(Layout), ctypes.c_int, ctypes.POINTER(NsOptions), ctypes.POINTER(ctypes.c_int)],
    ),
    "shardmuon_ns_plan_gram_iteration": (
        _c_status,
        [ctypes.POINTER(Layout), ctypes.c_int, ctypes.POINTER(NsOptions), ctypes.POINTER(ctypes.c_int)],
    ),
    "shardmuon_ns_estimate": (
        _c_status,
        [ctypes.POINTER(Layout), ctypes.c_int, ctypes.POINTER(NsOptions), ctypes.POINTER(ctypes.c_double)],
    ),
    "shardmuon_schedule_coefficients": (
        _c_status,
        [ctypes.c_int, ctypes.c_int, ctypes.POINTER(NsOptions), ctypes.POINTER(ctypes.c_double),
         ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double)],
    ),
    "shardmuon_muon_step": (
        _c_status,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(MuonParam), ctypes.c_int,
         ctypes.POINTER(MuonGroup), ctypes.c_int, ctypes.c_void_p],
    ),
    "shardmuon_muon_plan": (
        _c_status,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(MuonParam), ctypes.c_int,
         ctypes.POINTER(MuonGroup), ctypes.c_int, ctypes.POINTER(ctypes.c_int),
         ctypes.POINTER(ctypes.c_int)],
    ),
    "shardmuon_muon_plan_gram_iteration": (
        _c_status,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(MuonParam), ctypes.c_int,
         ctypes.POINTER(MuonGroup), ctypes.c_int, ctypes.POINTER(ctypes.c_int)],
    ),
    "shardmuon_muon_plan_applied_twice": (
        _c_status,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(MuonParam), ctypes.c_int,
         ctypes.POINTER(MuonGroup), ctypes.c_int, ctypes.POINTER(ctypes.c_int)],
    ),
    "shardmuon_muon_save": (
        _c_status,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(MuonParam),
         ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.POINTER(MuonGroup), ctypes.c_int,
         ctypes.c_int64, ctypes.c_void_p],
    ),
    "shardmuon_muon_load": (
        _c_status,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(MuonParam),
         ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.POINTER(MuonGroup), ctypes.c_int,
         ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p],
    ),
}
for _name, (_restype, _argtypes) in _signatures.items():
    _function = getattr(lib, _name)
    _function.restype = _restype
    _function.argtypes = _argtypes


def check(status: int) -> None:
    """Raises ShardmuonError with the library's message for a failed call."""
    if status != SUCCESS:
        name = lib.shardmuon_status_name(status).decode()
        raise ShardmuonError(status, f"{name}: {lib.shardmuon_last_error().decode()}")


def _check_abi():
    for type_name, struct in _STRUCTS.items():
        size, offset = ctypes.c_size_t(), ctypes.c_size_t()
        check(lib.shardmuon_abi_layout(type_name.encode(), None, ctypes.byref(size), None))
        if size.value != ctypes.sizeof(struct):
            raise ImportError(
                f"shardmuon: {type_name} is {size.value} bytes in {library_path} but "
                f"{ctypes.sizeof(struct)} in these bindings; rebuild or update the package"
            )
        for field, _ in struct._fields_:
            check(lib.shardmuon_abi_layout(type_name.encode(), field.encode(), ctypes.byref(size),
                                           ctypes.byref(offset)))
            if offset.value != getattr(struct, field).offset or size.value != getattr(struct, field).size:
                raise ImportError(f"shardmuon: {type_name}.{field} differs between {library_path} and these bindings")


_check_abi()


def version():
    parts = [ctypes.c_int() for _ in range(3)]
    check(lib.shardmuon_version(*[ctypes.byref(p) for p in parts]))
    return tuple(p.value for p in parts)


def build_info():
    """Which optional parts the library was built with: {"cuda": bool, "nccl": bool, "mpi": bool}."""
    parts = [ctypes.c_int() for _ in range(3)]
    check(lib.shardmuon_build_info(*[ctypes.byref(p) for p in parts]))
    return dict(zip(("cuda", "nccl", "mpi"), (bool(p.value) for p in parts)))
