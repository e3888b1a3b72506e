"""DTensor parameters (``torch.distributed.tensor``: torchtitan, FSDP2 and PyTorch's tensor
parallelism): which matrix the library sees, and over which process group it is split.

A DTensor on a device mesh has one placement per mesh dimension: ``Replicate()``, ``Shard(d)``
(the tensor's dim d cut into ``torch.chunk`` pieces along that mesh dimension) or ``Partial``.
The library takes a matrix split along one dim over one process group, so:

* a 2D parameter may be ``Shard(0)`` or ``Shard(1)`` on one mesh dimension and replicated on
  the others: rows or columns split over that mesh dimension's group (FSDP2's dim-0 sharding on
  a 1D mesh, or the column- and row-parallel layers of tensor parallelism);
* a 3D parameter (experts x rows x cols) may also be ``Shard(0)`` (expert parallelism): each
  rank then holds whole experts and orthogonalizes its own; besides that, ``Shard(2)`` on one
  mesh dimension splits every expert's columns over its group;
* with no split at all, a parameter on a 1D mesh is replicated over the mesh's group (so that
  owners can share the work), and on a larger mesh each rank orthogonalizes it on its own;
* a split over several mesh dimensions (FSDP2 with tensor parallelism: ``(Shard(0),
  Shard(1))``, or a strided shard) is first gathered over all but one of them (see
  ``sharding``).

``Partial`` placements are refused with an error.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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


def sharding(tensor, name: str) -> Sharding:
    """How the library sees a 2D or 3D DTensor parameter.

    The library takes a matrix cut along one dim over one process group. One plain ``Shard``
    on a dim it can take (rows or columns; a 3D stack's columns) is used as it is; a stack's
    ``Shard(0)`` leaves whole experts on each rank. Any other cut (a second split mesh
    dimension, a strided shard, a stack's rows) is gathered first: ``regroup`` then gives the
    placements to redistribute to, which keep the cut over the largest mesh dimension. That
    costs an all-gather over the gathered mesh dimensions, and their ranks then orthogonalize
    the same matrix, each one over the kept dimension's group."""
    if tensor.ndim not in (2, 3):
        raise ValueError(f"{name}: a DTensor Muon parameter is 2D or 3D (experts x rows x cols), "
                         f"got {tensor.ndim}D")
    mesh = tensor.device_mesh
    allowed = (0, 1) if tensor.ndim == 2 else (2,)
    usable = []  # (mesh dim, tensor dim) of plain cuts the library can take as they are
    gathered = []  # mesh dims of the cuts it cannot
    experts_split = False
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate() or mesh.size(mesh_dim) == 1:
            continue  # a whole extent
        # A strided shard (FSDP2 over a tensor-parallel dim) is not is_shard() in PyTorch 2.11.
        strided = hasattr(placement, "split_factor")
        if not (placement.is_shard() or strided):
            raise ValueError(f"{name}: {describe(tensor)}: mesh dimension {mesh_dim} has {placement}; "
                             "shardmuon takes Shard and Replicate placements (reduce a Partial "
                             "gradient first)")
        dim = placement.dim % tensor.ndim
        if tensor.ndim == 3 and dim == 0:
            experts_split = True  # expert parallelism: whole experts on each rank
        elif type(placement) is Shard and dim in allowed:
            usable.append((mesh_dim, dim))
        else:
            gathered.append(mesh_dim)
    kept = max(usable, key=lambda cut: (mesh.size(cut[0]), cut[0]), default=None)
    gathered += [cut[0] for cut in usable if cut != kept]
    regroup = None
    if gathered:
        placements = list(tensor.placements)
        for mesh_dim in gathered:
            placements[mesh_dim] = Replicate()
        regroup = tuple(placements)
    experts = tensor.to_local().shape[0] if tensor.ndim == 3 else 1
    if kept is not None:
        return Sharding(normalize_group(mesh.get_group(kept[0])), kept[1], experts, regroup)
    if mesh.ndim == 1 and not experts_split:
        return Sharding(normalize_group(mesh.get_group(0)), None, experts, regroup)
    return Sharding(LOCAL, None, experts, regroup)


def redistributed(tensor, placements):
    """A copy of a DTensor under other placements, its local piece contiguous (the library
    takes dense row-major pieces)."""
    copy = tensor.redistribute(device_mesh=tensor.device_mesh, placements=placements)
    local = copy.to_local()
    if local.is_contiguous():
        return copy
    return DTensor.from_local(local.contiguous(), tensor.device_mesh, placements, run_check=False,
                              shape=tensor.shape, stride=tensor.stride())


def write_into(destination, source) -> None:
    """Copies a DTensor's values into another of the same shape under the destination's own
    placements (from a gathered copy back to a split: each rank keeps its piece)."""
    back = source.redistribute(device_mesh=destination.device_mesh, placements=destination.placements)
    destination.to_local().copy_(back.to_local())
