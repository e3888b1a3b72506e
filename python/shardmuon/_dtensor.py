"""DTensor parameters (``torch.distributed.tensor``: torchtitan, FSDP2 and PyTorch's tensor
parallelism): which matrix the library sees, and over which process group it is split.

A DTensor on a device mesh has one placement per mesh dimension: ``Replicate()``, ``Shard(d)``
(the tensor's dim d cut into ``torch.chunk`` pieces along that mesh dimension) or ``Partial``.
The library takes a matrix split along one dim over one process group, so:

* a 2D parameter may be ``Shard(0)`` or ``Shard(1)`` on one mesh dimension and replicated on
  the others: rows or columns split over that mesh dimension's group (FSDP2's dim-0 sharding on
  a 1D mesh, or the column- and row-parallel layers of tensor parallelism);
* a 3D parameter (experts x rows x cols) may also be ``Shard(0)`` (expert parallelism): each
  rank then holds whole experts and orthogonalizes its own; besides that, ``Shard(2)`` splits
  every expert's columns;
* with no split at all, a parameter on a 1D mesh is replicated over the mesh's group (so that
  owners can share the work), and on a larger mesh each rank orthogonalizes it on its own;
* a split over several mesh dimensions (FSDP2 with tensor parallelism: ``(_StridedShard(0),
  Shard(0))`` or ``(Shard(0), Shard(1))``) is taken over one process group of all their ranks
  (see ``sharding``).

``Partial`` placements are refused with an error.

Why a split over several mesh dimensions needs no gather: Newton-Schulz commutes with
permutations of rows and of columns (for permutation matrices P and Q, the iteration on P X Q
is P (the iteration on X) Q: its products X X^T and X^T X just permute along), and so do the
Frobenius norm, the momentum and the weight decay. So when each rank holds some rows (or some
columns) of the matrix, in whatever order and however strided, the library may treat the
pieces as a plain split in its group's rank order. Only a fused weight's row blocks
(``muon_row_blocks``) need rows in their true order.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch.distributed as dist

from ._runtime import LOCAL, normalize_group

try:  # public since PyTorch 2.4; torch.distributed._tensor before that (2.1-2.3)
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - depends on the installed PyTorch
    try:
        from torch.distributed._tensor import DTensor, Replicate, Shard
    except ImportError:
        DTensor = Replicate = Shard = None


def is_dtensor(tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_tensor(tensor):
    """The rank's own piece of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def describe(tensor) -> str:
    return f"placements {tuple(tensor.placements)} on {tensor.device_mesh}"


class Sharding(NamedTuple):
    """How the library sees a DTensor parameter (see ``sharding``)."""

    process_group: object  # None: the world; LOCAL: this rank alone
    dim: Optional[int]  # the tensor's dim cut over the group, or None: the group holds it whole
    experts: int  # experts of a 3D parameter on this rank (1 for a 2D parameter)
    regroup: Optional[tuple]  # placements to redistribute it to first, or None
    note: Optional[str] = None  # why a split is gathered, and how to avoid it (see _gathered)


class _Missing:
    def __repr__(self):
        return "no process group"


_MISSING = _Missing()


def sharding(tensor, name: str, row_blocks: int = 1) -> Sharding:
    """How the library sees a 2D or 3D DTensor parameter (of ``row_blocks`` stacked matrices).

    The library takes a matrix cut along one dim over one process group. When every cut is
    along one dim it can take (rows or columns; a 3D stack's columns), the pieces are used as
    they are over the group of all the cut mesh dimensions' ranks, whatever their order (see
    the module's note). Otherwise (rows and columns cut over different mesh dimensions, a
    stack's rows, a fused weight's rows out of order) ``regroup`` gives placements to
    redistribute to first: the same mesh dimensions all cutting one dim, which DTensor does
    with an all-to-all. Over several mesh dimensions that group is the world when they span
    it, or one the user made with ``DeviceMesh._flatten`` (torchtitan's way); without one, the
    cuts but the largest are gathered instead, and the ranks along them then orthogonalize the
    same matrix over the kept dimension's group."""
    if tensor.ndim not in (2, 3):
        raise ValueError(f"{name}: a DTensor Muon parameter is 2D or 3D (experts x rows x cols), "
                         f"got {tensor.ndim}D")
    mesh = tensor.device_mesh
    cuts = {}  # mesh dim -> the tensor dim it cuts, of every split but the experts'
    experts_split = False
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate() or mesh.size(mesh_dim) == 1:
            continue  # a whole extent
        # A strided shard (FSDP2 over a tensor-parallel dim) is not is_shard() in PyTorch 2.11.
        if not (placement.is_shard() or hasattr(placement, "split_factor")):
            raise ValueError(f"{name}: {describe(tensor)}: mesh dimension {mesh_dim} has {placement}; "
                             "shardmuon takes Shard and Replicate placements (reduce a Partial "
                             "gradient first)")
        dim = placement.dim % tensor.ndim
        if tensor.ndim == 3 and dim == 0:
            experts_split = True  # expert parallelism: whole experts on each rank
        else:
            cuts[mesh_dim] = dim
    experts = tensor.to_local().shape[0] if tensor.ndim == 3 else 1
    if not cuts:
        if mesh.ndim == 1 and not experts_split:
            return Sharding(normalize_group(mesh.get_group(0)), None, experts, None)
        return Sharding(LOCAL, None, experts, None)
    group = _group_over(mesh, sorted(cuts))
    if group is _MISSING:
        return _gathered(tensor, cuts, experts, experts_split, row_blocks)
    columns = tensor.ndim - 1  # the dim of the columns (of every expert, in a stack)
    dims = set(cuts.values())
    if len(dims) == 1:
        dim = dims.pop()
        if dim == columns or (tensor.ndim == 2 and (row_blocks == 1 or _in_rank_order(tensor, cuts, group))):
            return Sharding(group, dim, experts, None)
    # One dim for all: the outermost cut's, unless rows cannot be taken out of order.
    target = columns if tensor.ndim == 3 or row_blocks > 1 else cuts[min(cuts)]
    placements = list(tensor.placements)
    for mesh_dim in cuts:
        placements[mesh_dim] = Shard(target)
    return Sharding(group, target, experts, tuple(placements))


def _ranks_along(mesh, mesh_dims) -> list:
    """The world ranks that share this rank's coordinates off ``mesh_dims``, in the mesh's
    row-major order over ``mesh_dims``."""
    coordinate = mesh.get_coordinate()
    index = tuple(slice(None) if d in mesh_dims else coordinate[d] for d in range(mesh.ndim))
    return mesh.mesh[index].flatten().tolist()


def _in_rank_order(tensor, cuts, group) -> bool:
    """Whether the pieces of plain ``Shard`` cuts along one dim are in the group's rank order.
    Nested plain cuts are contiguous pieces in the mesh's row-major order over the cut mesh
    dimensions, but a group's ranks are sorted by world rank (``new_group`` sorts them), so a
    mesh laid out otherwise puts them out of order. Every rank of the group sees the same."""
    if any(type(tensor.placements[mesh_dim]) is not Shard for mesh_dim in cuts):
        return False  # a strided shard's pieces are not contiguous
    ranks = _ranks_along(tensor.device_mesh, sorted(cuts))
    group = dist.group.WORLD if group is None else group
    return [dist.get_group_rank(group, rank) for rank in ranks] == list(range(len(ranks)))


def _group_over(mesh, mesh_dims):
    """The process group of the ranks that share this rank's coordinates off ``mesh_dims``:
    that dimension's group for one; over several, the world when they span it, else a group
    made by ``DeviceMesh._flatten`` over exactly those ranks, else _MISSING. (Making a group
    here would be a collective of every rank of the world, which a step cannot promise.)"""
    if len(mesh_dims) == 1:
        return normalize_group(mesh.get_group(mesh_dims[0]))
    ranks = set(_ranks_along(mesh, mesh_dims))
    if len(ranks) == dist.get_world_size():
        return None
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    for flattened in getattr(root, "_flatten_mapping", {}).values():
        if flattened.ndim == 1 and set(flattened.mesh.flatten().tolist()) == ranks:
            return normalize_group(flattened.get_group(0))
    return _MISSING


def _gathered(tensor, cuts, experts, experts_split, row_blocks) -> Sharding:
    """Without a group over all the cut mesh dimensions: keep the plain cut the library can
    take over the largest mesh dimension, and gather the others (``regroup``; ``note`` says
    why, and how to avoid it)."""
    mesh = tensor.device_mesh

    def can_keep(mesh_dim, dim):
        if type(tensor.placements[mesh_dim]) is not Shard:
            return False
        if tensor.ndim == 3:
            return dim == 2
        group = normalize_group(mesh.get_group(mesh_dim))
        return dim == 1 or row_blocks == 1 or _in_rank_order(tensor, {mesh_dim: dim}, group)

    usable = [(mesh_dim, dim) for mesh_dim, dim in cuts.items() if can_keep(mesh_dim, dim)]
    kept = max(usable, key=lambda cut: (mesh.size(cut[0]), cut[0]), default=None)
    gathered = [mesh_dim for mesh_dim in sorted(cuts) if kept is None or mesh_dim != kept[0]]
    placements = list(tensor.placements)
    for mesh_dim in gathered:
        placements[mesh_dim] = Replicate()
    regroup, note = tuple(placements), _gather_note(mesh, sorted(cuts), gathered)
    if kept is not None:
        return Sharding(normalize_group(mesh.get_group(kept[0])), kept[1], experts, regroup, note)
    if mesh.ndim == 1 and not experts_split:
        return Sharding(normalize_group(mesh.get_group(0)), None, experts, regroup, note)
    return Sharding(LOCAL, None, experts, regroup, note)


def _gather_note(mesh, cut_dims, gathered_dims) -> str:
    """Why a split over ``cut_dims`` is gathered over ``gathered_dims``, and the call that
    avoids it (the front end warns with it once)."""
    names = getattr(mesh, "mesh_dim_names", None)

    def label(mesh_dims):
        return ", ".join(repr(names[d]) if names else f"mesh dimension {d}" for d in mesh_dims)

    ranks = math.prod(mesh.size(d) for d in cut_dims)
    flatten = (f"mesh[{label(cut_dims)}]._flatten()" if names else
               "DeviceMesh._flatten() on the submesh of those dimensions")
    return (f"it is cut over the mesh dimensions {label(cut_dims)} ({ranks} ranks), which no process "
            "group holds (they do not span the world, and no DeviceMesh._flatten() group over exactly "
            f"them was found), so it is gathered over {label(gathered_dims)} and the ranks along "
            f"{'it' if len(gathered_dims) == 1 else 'them'} repeat its orthogonalization. To step "
            f"it over all {ranks} ranks, flatten those dimensions once, on every rank, before the "
            f"first step: {flatten}")


def redistributed(tensor, placements):
    """A copy of a DTensor under other placements, its local piece contiguous (the library
    takes dense row-major pieces)."""
    copy = tensor.redistribute(device_mesh=tensor.device_mesh, placements=placements)
    local = copy.to_local()
    if local.is_contiguous():
        return copy
    return DTensor.from_local(local.contiguous(), tensor.device_mesh, placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def piece_bytes(tensor, placements) -> int:
    """The bytes of a rank's share of ``tensor`` under ``placements``: its size over the
    number of pieces the Shard placements cut it into, rounded up (the pieces of an uneven cut
    differ by a row or a column). From the global shape, so every rank finds the same."""
    mesh = tensor.device_mesh
    pieces = math.prod(mesh.size(mesh_dim) for mesh_dim, placement in enumerate(placements)
                       if not placement.is_replicate())
    return -(-tensor.numel() // pieces) * tensor.element_size()


def write_into(destination, source) -> None:
    """Copies a DTensor's values into another of the same shape under the destination's own
    placements (from a gathered copy back to a split: each rank keeps its piece)."""
    back = source.redistribute(device_mesh=destination.device_mesh, placements=destination.placements)
    destination.to_local().copy_(back.to_local())
