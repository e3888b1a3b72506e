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
  owners can share the work), and on a larger mesh each rank orthogonalizes it on its own.

Splits over two mesh dimensions at once (FSDP2 with tensor parallelism: ``(Shard(0),
Shard(1))`` or a strided shard), and ``Partial`` placements, are refused with an error.
"""

from __future__ import annotations

from typing import Optional, Tuple

from ._runtime import LOCAL, normalize_group

try:  # public since PyTorch 2.4; torch.distributed._tensor before that (2.1-2.3)
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - depends on the installed PyTorch
    try:
        from torch.distributed._tensor import DTensor, Shard
    except ImportError:
        DTensor = Shard = None


def is_dtensor(tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local_tensor(tensor):
    """The rank's own piece of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def describe(tensor) -> str:
    return f"placements {tuple(tensor.placements)} on {tensor.device_mesh}"


def sharding(tensor, name: str) -> Tuple[object, Optional[int], int]:
    """(process group, split dim, local experts) of a 2D or 3D DTensor parameter.

    The group is the process group the matrix is split over (None: the world; ``LOCAL``: this
    rank alone); the split dim is the *tensor's* dim cut over that group (0 or 1 for a 2D
    parameter, 2 for a 3D one) or None when the group holds the whole matrix; local experts is
    how many experts of a 3D parameter this rank holds (1 for a 2D parameter)."""
    if tensor.ndim not in (2, 3):
        raise ValueError(f"{name}: a DTensor Muon parameter is 2D or 3D (experts x rows x cols), "
                         f"got {tensor.ndim}D")
    mesh = tensor.device_mesh
    splits = []  # (mesh dim, tensor dim) of the cuts that span more than one rank
    experts_split = False
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard() or type(placement) is not Shard:
            raise ValueError(f"{name}: {describe(tensor)}: mesh dimension {mesh_dim} has {placement}; "
                             "shardmuon takes Shard(dim) and Replicate() placements (reduce a "
                             "Partial gradient first; a strided shard is not a contiguous piece)")
        if mesh.size(mesh_dim) == 1:
            continue  # one piece: the whole extent
        dim = placement.dim % tensor.ndim
        if tensor.ndim == 3 and dim == 0:
            experts_split = True  # expert parallelism: whole experts on each rank
        else:
            splits.append((mesh_dim, dim))
    allowed = (0, 1) if tensor.ndim == 2 else (2,)
    if len(splits) > 1 or any(dim not in allowed for _, dim in splits):
        takes = "rows or columns" if tensor.ndim == 2 else "Shard(0) experts, and Shard(2) columns"
        raise ValueError(f"{name}: {describe(tensor)}: shardmuon orthogonalizes a matrix split along "
                         f"one dim over one mesh dimension ({takes}); redistribute it, or shard it "
                         "over one mesh dimension")
    experts = tensor.to_local().shape[0] if tensor.ndim == 3 else 1
    if splits:
        mesh_dim, dim = splits[0]
        return normalize_group(mesh.get_group(mesh_dim)), dim, experts
    if mesh.ndim == 1 and not experts_split:
        return normalize_group(mesh.get_group(0)), None, experts
    return LOCAL, None, experts
