"""How the front end maps a DTensor's placements onto the library's one layout (a matrix cut
along one dim over one process group), on stand-in meshes and placements, so that CI (whose
PyTorch 1.13 has no DTensor) checks every decision of _dtensor.sharding: which group, which
dim, and what to redistribute to first. test_dtensor.py runs the same layouts for real on
PyTorch 2.x, against the float64 reference."""

import math
import types

import pytest
import torch

import shardmuon.torch as st
from shardmuon import _dtensor


class FakeShard:
    def __init__(self, dim):
        self.dim = dim

    def is_shard(self):
        return True

    def is_replicate(self):
        return False

    def __eq__(self, other):
        return type(other) is FakeShard and other.dim == self.dim

    def __repr__(self):
        return f"S{self.dim}"


class FakeStridedShard:  # like PyTorch 2.11's _StridedShard: not is_shard(), has split_factor
    def __init__(self, dim):
        self.dim, self.split_factor = dim, 2

    def is_shard(self):
        return False

    def is_replicate(self):
        return False


class FakeReplicate:
    def is_shard(self):
        return False

    def is_replicate(self):
        return True

    def __eq__(self, other):
        return type(other) is FakeReplicate

    def __repr__(self):
        return "R"


class FakePartial:
    def is_shard(self):
        return False

    def is_replicate(self):
        return False

    def __repr__(self):
        return "Partial()"


class FakeGroup:
    """A process group: its ranks sorted, as new_group sorts them."""

    def __init__(self, ranks):
        self.ranks = sorted(ranks)


class FakeMesh:
    """A device mesh over a tensor of world ranks, seen from world rank `me`."""

    def __init__(self, ranks, me, root=None):
        self.mesh, self.me, self.root = torch.as_tensor(ranks), me, root
        self.ndim = self.mesh.ndim
        self._flatten_mapping = {}
        self.mesh_dim_names = None

    def size(self, dim):
        return self.mesh.shape[dim]

    def get_coordinate(self):
        return tuple(int(x) for x in (self.mesh == self.me).nonzero()[0])

    def get_group(self, dim):
        coordinate = self.get_coordinate()
        index = tuple(slice(None) if d == dim else coordinate[d] for d in range(self.ndim))
        return FakeGroup(self.mesh[index].tolist())

    def _get_root_mesh(self):
        return self.root or self


class FakeDTensor:
    def __init__(self, shape, mesh, placements):
        self.shape, self.device_mesh, self.placements = shape, mesh, tuple(placements)
        self.ndim = len(shape)

    def to_local(self):  # only a 3D stack's experts are read: two on each rank here
        return torch.empty(2, *self.shape[1:]) if self.ndim == 3 else torch.empty(0)

    def numel(self):
        return math.prod(self.shape)

    def element_size(self):  # float64
        return 8


@pytest.fixture
def world(monkeypatch):
    """Stand-ins for DTensor's placements and torch.distributed's group queries; returns a
    function that sets the world's size."""
    monkeypatch.setattr(_dtensor, "Shard", FakeShard)
    monkeypatch.setattr(_dtensor, "Replicate", FakeReplicate)
    state = {"size": 4}
    fake_dist = types.SimpleNamespace(
        get_world_size=lambda: state["size"],
        get_group_rank=lambda group, rank: group.ranks.index(rank),
        group=types.SimpleNamespace(WORLD=None))
    monkeypatch.setattr(_dtensor, "dist", fake_dist)

    def set_size(size):
        state["size"] = size
        fake_dist.group.WORLD = FakeGroup(range(size))

    set_size(4)
    return set_size


def placements_of(codes):
    kinds = {"R": lambda d: FakeReplicate(), "S": FakeShard, "T": FakeStridedShard, "P": lambda d: FakePartial()}
    return [kinds[code[0]](int(code[1:] or 0)) for code in codes]


def decide(mesh, shape, codes, row_blocks=1):
    """(ranks of the group or "world"/"local", the dim cut, the placements to redistribute to)."""
    how = _dtensor.sharding(FakeDTensor(shape, mesh, placements_of(codes)), "w", row_blocks)
    if how.process_group is None:
        group = "world"
    elif how.process_group is _dtensor.LOCAL:
        group = "local"
    else:
        group = how.process_group.ranks
    regroup = None if how.regroup is None else "".join(repr(p) for p in how.regroup)
    return group, how.dim, regroup


# On a 2 x 2 mesh [[0, 1], [2, 3]] seen from rank 1 (dp coordinate 0, tp coordinate 1): dp's
# group is [1, 3], tp's [0, 1].
SQUARE = [((40, 33), ("R", "S0"), 1, ([0, 1], 0, None)),     # rows over tp
          ((27, 50), ("S1", "R"), 1, ([1, 3], 1, None)),     # columns over dp
          ((20, 12), ("R", "R"), 1, ("local", None, None)),  # each rank on its own
          ((4, 9, 14), ("S0", "S2"), 1, ([0, 1], 2, None)),  # experts over dp, columns over tp
          ((6, 10, 7), ("S0", "R"), 1, ("local", None, None)),
          ((26, 15), ("R", "S0"), 2, ([0, 1], 0, None)),     # a fused weight's rows, in order
          ((45, 20), ("S0", "S0"), 1, ("world", 0, None)),   # both mesh dims: as they are
          ((45, 20), ("T0", "S0"), 1, ("world", 0, None)),   # FSDP2 over a column-parallel layer
          ((4, 10, 13), ("S2", "S2"), 1, ("world", 2, None)),
          ((24, 17), ("S0", "S0"), 2, ("world", 0, None)),   # nested rows in the world's order
          ((41, 35), ("S0", "S1"), 1, ("world", 0, "S0S0")),  # FSDP2 over a row-parallel layer
          ((35, 41), ("S1", "S0"), 1, ("world", 1, "S1S1")),
          ((2, 9, 14), ("R", "S1"), 1, ([0, 1], 2, "RS2")),  # every expert's rows
          ((24, 16), ("S1", "S0"), 3, ("world", 1, "S1S1")),
          ((24, 17), ("T0", "S0"), 2, ("world", 1, "S1S1"))]  # strided rows are out of order


@pytest.mark.parametrize("shape, codes, row_blocks, expected", SQUARE)
def test_a_square_mesh(world, shape, codes, row_blocks, expected):
    assert decide(FakeMesh([[0, 1], [2, 3]], 1), shape, codes, row_blocks) == expected


# The mesh [[2, 0], [3, 1]] seen from rank 0: tp's group [0, 2] holds its pieces in the order
# 2, 0 (out of the group's rank order), dp's [0, 1] in order; the world's order is 2, 0, 3, 1.
PERMUTED = [((45, 20), ("S0", "S0"), 1, ("world", 0, None)),  # any order will do
            ((30, 22), ("R", "S0"), 1, ([0, 2], 0, None)),
            ((26, 15), ("R", "S0"), 2, ([0, 2], 1, "RS1")),     # a fused weight's rows need it
            ((26, 15), ("S0", "R"), 2, ([0, 1], 0, None)),
            ((24, 17), ("S0", "S0"), 2, ("world", 1, "S1S1"))]


@pytest.mark.parametrize("shape, codes, row_blocks, expected", PERMUTED)
def test_a_mesh_out_of_rank_order(world, shape, codes, row_blocks, expected):
    assert decide(FakeMesh([[2, 0], [3, 1]], 0), shape, codes, row_blocks) == expected


# The ("dp", "tp") half of a 2 x 2 x 2 mesh of 8 ranks, seen from rank 5 (its half: [[4, 5],
# [6, 7]]), without and with a flattened group over those four ranks.
SUBMESH = {False: [((41, 35), ("S0", "S1"), 1, ([4, 5], 1, "RS1")),  # gathered over dp
                   ((45, 20), ("S0", "S0"), 1, ([4, 5], 0, "RS0")),
                   ((45, 20), ("T0", "S0"), 1, ([4, 5], 0, "RS0")),
                   ((3, 8, 11), ("S1", "S2"), 1, ([4, 5], 2, "RS2")),
                   ((30, 22), ("S1", "R"), 1, ([5, 7], 1, None))],
           True: [((41, 35), ("S0", "S1"), 1, ([4, 5, 6, 7], 0, "S0S0")),
                  ((45, 20), ("S0", "S0"), 1, ([4, 5, 6, 7], 0, None)),
                  ((45, 20), ("T0", "S0"), 1, ([4, 5, 6, 7], 0, None)),
                  ((3, 8, 11), ("S1", "S2"), 1, ([4, 5, 6, 7], 2, "S2S2")),
                  ((30, 22), ("S1", "R"), 1, ([5, 7], 1, None))]}


@pytest.mark.parametrize("flattened", [False, True])
def test_a_submesh_takes_a_flattened_group_or_gathers(world, flattened):
    world(8)
    root = FakeMesh(torch.arange(8).reshape(2, 2, 2), 5)
    root._flatten_mapping["pp_tp"] = FakeMesh([1, 5], 5, root)  # another flattened group
    if flattened:
        root._flatten_mapping["dp_tp"] = FakeMesh([4, 5, 6, 7], 5, root)
    half = FakeMesh(root.mesh[1], 5, root)
    for shape, codes, row_blocks, expected in SUBMESH[flattened]:
        assert decide(half, shape, codes, row_blocks) == expected, (shape, codes)
    # Where it gathers, a note says why and how to avoid it (the front end warns with it).
    half.mesh_dim_names = ("dp", "tp")
    notes = [_dtensor.sharding(FakeDTensor(shape, half, placements_of(codes)), "w", row_blocks).note
             for shape, codes, row_blocks, _ in SUBMESH[flattened]]
    if flattened:
        assert notes == [None] * 5, notes
    else:
        assert notes[4] is None  # one cut: its mesh dimension's group
        for note in notes[:4]:
            assert "mesh dimensions 'dp', 'tp' (4 ranks)" in note and "gathered over 'dp'" in note, note
            assert note.endswith("before the first step: mesh['dp', 'tp']._flatten()"), note
    half.mesh_dim_names = None
    if not flattened:
        note = _dtensor.sharding(FakeDTensor((41, 35), half, placements_of(["S0", "S1"])), "w").note
        assert "mesh dimensions mesh dimension 0, mesh dimension 1" in note and "gathered over mesh dimension 0" in note
        assert note.endswith("DeviceMesh._flatten() on the submesh of those dimensions"), note
    # Gathered over two of three mesh dimensions (8 of 16 ranks): the last one is kept.
    world(16)
    cube = FakeMesh(torch.arange(8).reshape(2, 2, 2), 5)
    how = _dtensor.sharding(FakeDTensor((41, 35), cube, placements_of(["S0", "S0", "S1"])), "w")
    assert (how.process_group.ranks, how.dim) == ([4, 5], 1)
    assert "gathered over mesh dimension 0, mesh dimension 1 and the ranks along them" in how.note, how.note


def test_a_one_dim_mesh_holds_a_replicated_parameter_over_its_group(world):
    world(3)
    line = FakeMesh([0, 1, 2], 2)
    assert decide(line, (16, 16), ("R",)) == ([0, 1, 2], None, None)
    assert decide(line, (16, 16), ("S1",)) == ([0, 1, 2], 1, None)


def test_partial_placements_and_other_shapes_are_refused(world):
    square = FakeMesh([[0, 1], [2, 3]], 1)
    with pytest.raises(ValueError, match="w: .*mesh dimension 1 has Partial.*reduce a Partial"):
        decide(square, (8, 6), ("R", "P"))
    with pytest.raises(ValueError, match="w: a DTensor Muon parameter is 2D or 3D"):
        decide(square, (2, 3, 4, 5), ("R", "S0"))


def test_redistributed_copies_are_cut_into_runs_under_the_byte_budget(world):
    """A step redistributes the parameters of a group that need it in runs whose copies
    (parameter, gradient and momentum) fit Muon's redistribution_bytes, at least one each;
    sized by global shapes, so that every rank cuts the same runs."""
    square = FakeMesh([[0, 1], [2, 3]], 1)
    rows = placements_of(["S0", "S0"])
    # 24 x 20 float64 over 4 pieces: 960 bytes each; gathered over dp (tp's pieces): 1920;
    # 25 x 21 over 4: 131.25 elements, rounded up.
    assert _dtensor.piece_bytes(FakeDTensor((24, 20), square, rows), rows) == 960
    assert _dtensor.piece_bytes(FakeDTensor((24, 20), square, rows), placements_of(["R", "S1"])) == 1920
    assert _dtensor.piece_bytes(FakeDTensor((25, 21), square, rows), rows) == 132 * 8
    assert _dtensor.piece_bytes(FakeDTensor((24, 20), square, rows), placements_of(["R", "R"])) == 3840
    entries = [{"param": FakeDTensor(shape, square, rows), "regroup": rows}
               for shape in [(24, 20), (24, 20), (48, 20), (24, 20), (12, 20)]]
    copies = [2880, 2880, 5760, 2880, 1440]  # 3 x a piece
    for budget, runs in [(1 << 30, [[0, 1, 2, 3, 4]]), (5760, [[0, 1], [2], [3, 4]]),
                         (8640, [[0, 1], [2, 3], [4]]), (0, [[0], [1], [2], [3], [4]])]:
        optimizer = st.Muon([torch.zeros(2, 2)], redistribution_bytes=budget)
        cut = optimizer._redistribution_runs(entries)
        assert [[entries.index(e) for e in run] for run in cut] == runs, budget
        assert all(sum(copies[entries.index(e)] for e in run) <= budget for run in cut if len(run) > 1)
    assert optimizer._redistribution_runs([]) == [[]]  # one call for the group's other parameters
