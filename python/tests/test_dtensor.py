"""DTensor parameters (torchtitan, FSDP2 and PyTorch tensor parallelism) on several CPU
processes (gloo): on 1D meshes (rows or columns split, by DTensor's own chunking with empty
pieces, or uneven pieces given with from_local), on a 2 x 2 mesh (a split over one mesh
dimension or both, expert parallelism, replication, fused weights) and on half of a 2 x 2 x 2
mesh (with and without a flattened group), every step against the float64 reference on the
whole matrices, and plan() saying over how many ranks and under which placements; FSDP2,
alone, over a 2D mesh (HSDP) and with tensor parallelism, against the whole model; the
placements refused with an error on every rank; a step reusing the last one's arguments; the
state dict and torch.distributed.checkpoint (of Muon and TorchMuon); and NewtonSchulz on a
DTensor.

Needs PyTorch 2.1 or later (DTensor); Debian's PyTorch 1.13 skips this file, so these tests
run on the lent GPU machine's PyTorch (docs/GPU_RUNS.md)."""

import copy
import inspect
import warnings

import pytest
import torch

import reference
import reuse
import shardmuon
import shardmuon.torch as st
from processes import launch, shard_of, split
from shardmuon import _dtensor

pytestmark = pytest.mark.skipif(_dtensor.DTensor is None, reason="this PyTorch has no DTensor")

if _dtensor.DTensor is not None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

LEARNING_RATES = [0.02, 0.05, 0.01]
TOLERANCE = {torch.float64: 1e-11, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def distribute(whole, mesh, placements):
    """DTensor's own cut of a whole tensor that every rank holds (no scatter where the
    PyTorch can skip it). Of a copy: without the scatter, a replicated DTensor's piece is the
    whole tensor itself, which the step would then update under the reference's feet."""
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(whole.clone(), mesh, placements, src_data_rank=None)
    return distribute_tensor(whole.clone(), mesh, placements)


def from_pieces(whole, mesh, dim, sizes, rank):
    """A DTensor split along dim into pieces of the given sizes (uneven, maybe empty)."""
    return DTensor.from_local(shard_of(whole, dim, sizes, rank), mesh, [Shard(dim)], run_check=False,
                              shape=whole.shape, stride=whole.stride())


def random_matrices(seed, shape, dtype, count):
    generator = torch.Generator().manual_seed(seed)
    weight = (0.05 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)
    grads = [torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype) for _ in range(count)]
    return weight, grads


def reference_steps(weight, grads, row_blocks=1):
    """The float64 reference after len(grads) steps of LEARNING_RATES."""
    return reference.muon_steps(weight, grads, LEARNING_RATES, row_blocks=row_blocks, weight_decay=0.1)


def run_steps(optimizer, params, grads_of):
    """Three steps with the learning rate changed every step; grads_of(i, step) is a DTensor."""
    for step, lr in enumerate(LEARNING_RATES):
        optimizer.param_groups[0]["lr"] = lr
        for i, p in enumerate(params):
            p.grad = grads_of(i, step)
        optimizer.step()


def check_pieces(params, cut_reference, dtypes, rank):
    for i, p in enumerate(params):
        expected = cut_reference(i)
        local = p.to_local()
        assert local.shape == expected.shape, (rank, i, local.shape, expected.shape)
        if expected.numel() == 0:
            continue
        error = reference.relative_error(local, expected)
        assert error < TOLERANCE[dtypes[i]], (rank, i, error)


# (rows, cols, placement, dtype, pieces): pieces None means DTensor's own chunking (5 rows
# over 4 ranks: 2, 2, 1 and an empty piece); else uneven weights for from_local.
ONE_DIM = [(37, 53, 0, torch.float64, None), (53, 37, 1, torch.float64, None),
           (29, 41, 1, torch.float32, None), (44, 18, 0, torch.bfloat16, None),
           (16, 16, -1, torch.float64, None), (5, 12, 0, torch.float64, None),
           (30, 24, 0, torch.float64, {2: [2, 1], 3: [3, 0, 2], 4: [1, 3, 0, 2]})]


def _one_dim_mesh(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    wholes, params, grads = [], [], []
    for i, (rows, cols, dim, dtype, pieces) in enumerate(ONE_DIM):
        weight, g = random_matrices(100 + i, (rows, cols), dtype, len(LEARNING_RATES))
        if pieces is None:
            placements = [Replicate() if dim == -1 else Shard(dim)]

            def cut(t, placements=placements):
                return distribute(t, mesh, placements)
        else:
            sizes = split(rows if dim == 0 else cols, pieces[world])

            def cut(t, dim=dim, sizes=sizes):
                return from_pieces(t, mesh, dim, sizes, rank)
        params.append(torch.nn.Parameter(cut(weight)))
        grads.append([cut(x) for x in g])
        wholes.append((weight, g, cut))
    optimizer = st.Muon(params, lr=LEARNING_RATES[0], weight_decay=0.1)
    plan = optimizer.plan()
    assert len(plan) == len(params)
    run_steps(optimizer, params, lambda i, step: grads[i][step])
    for p in params:  # the momentum is a DTensor like its parameter (for DCP)
        momentum = optimizer.state[p]["momentum_buffer"]
        assert isinstance(momentum, DTensor) and momentum.placements == p.placements
    check_pieces(params, lambda i: wholes[i][2](reference_steps(*wholes[i][:2])).to_local(),
                 [x[3] for x in ONE_DIM], rank)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_dim_mesh_matches_the_whole_matrix_reference(world):
    launch(_one_dim_mesh, world)


# On a 2 x 2 mesh ("dp", "tp"): (shape, placements, muon_row_blocks, then what plan() says:
# the ranks it is stepped over, and the placements it is redistributed to or None).
TWO_DIM = [((40, 33), ("R", "S0"), 1, 2, None),     # rows over tp
           ((27, 50), ("S1", "R"), 1, 2, None),     # columns over dp
           ((20, 12), ("R", "R"), 1, 1, None),      # each rank on its own
           ((4, 9, 14), ("S0", "S2"), 1, 2, None),  # experts over dp, their columns over tp
           ((6, 10, 7), ("S0", "R"), 1, 1, None),   # expert parallelism: whole experts
           ((3, 8, 11), ("R", "R"), 1, 1, None),
           ((26, 15), ("R", "S0"), 2, 2, None),     # a fused weight's rows, in order
           # Over both mesh dimensions: the world's 4 ranks, the pieces as they are.
           ((45, 20), ("S0", "S0"), 1, 4, None),    # rows cut over dp, then each piece over tp
           ((3, 20), ("S0", "S0"), 1, 4, None),     # pieces of 1, 1, 1 and 0 rows
           ((4, 10, 13), ("S2", "S2"), 1, 4, None),
           # Redistributed (an all-to-all) so that one dim is cut.
           ((41, 35), ("S0", "S1"), 1, 4, ("S0", "S0")),  # FSDP2's rows, tensor-parallel columns
           ((35, 41), ("S1", "S0"), 1, 4, ("S1", "S1")),
           ((3, 20), ("S0", "S1"), 1, 4, ("S0", "S0")),
           ((2, 9, 14), ("R", "S1"), 1, 2, ("R", "S2")),  # every expert's rows
           ((24, 16), ("S1", "S0"), 3, 4, ("S1", "S1")),  # a fused weight's rows
           ((24, 17), ("S0", "S0"), 2, 4, None)]  # in the world's rank order


def placements_of(codes):
    return [Replicate() if code == "R" else Shard(int(code[1])) for code in codes]


def parameters_of(mesh, cases, seed, **options):
    """The whole matrices and DTensor parameters of `cases` (as TWO_DIM), and the optimizer
    (Muon with `options`)."""
    wholes, params, grads = [], [], []
    for i, (shape, codes, row_blocks, _, _) in enumerate(cases):
        weight, g = random_matrices(seed + i, shape, torch.float64, len(LEARNING_RATES))
        placements = placements_of(codes)
        params.append(torch.nn.Parameter(distribute(weight, mesh, placements)))
        params[-1].muon_row_blocks = row_blocks
        grads.append([distribute(x, mesh, placements) for x in g])
        wholes.append((weight, g, placements, row_blocks))
    return wholes, params, grads, st.Muon(params, lr=LEARNING_RATES[0], weight_decay=0.1, **options)


def counting_step_calls():
    """From now on in this process, the number of parameters of each library step call."""
    from shardmuon import _capi
    step = _capi.lib.shardmuon_muon_step
    calls = []

    def counted(*arguments):
        calls.append(arguments[3])
        return step(*arguments)

    _capi.lib.shardmuon_muon_step = counted
    return calls


def check_plan(optimizer, params, cases):
    """plan() says over how many ranks and under which placements each one is stepped."""
    plan = optimizer.plan()
    for i, (shape, codes, _, ranks, redistributed) in enumerate(cases):
        entry = plan[f"param_groups[0]['params'][{i}]"]
        expected = None if redistributed is None else tuple(placements_of(redistributed))
        assert (entry["group_size"], entry["redistributed"]) == (ranks, expected), (shape, codes, entry)


def steps_match_the_reference(rank, mesh, cases, seed, **options):
    """Three steps of Muon (with `options`) on DTensors of `cases` against the float64
    reference, after check_plan; returns the optimizer and the parameters."""
    wholes, params, grads, optimizer = parameters_of(mesh, cases, seed, **options)
    check_plan(optimizer, params, cases)
    run_steps(optimizer, params, lambda i, step: grads[i][step])
    expected = [distribute(reference_steps(weight, g, row_blocks), mesh, placements).to_local()
                for weight, g, placements, row_blocks in wholes]
    check_pieces(params, expected.__getitem__, [torch.float64] * len(params), rank)
    return optimizer, params


def _two_dim_mesh(rank, world):
    steps_match_the_reference(rank, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), TWO_DIM, 200)


def test_two_dim_mesh_matches_the_whole_matrix_reference():
    launch(_two_dim_mesh, 4)


# Four weights of FSDP2 over row-parallel layers, redistributed, and one split over both mesh
# dimensions as it is: all over the world's 4 ranks. A copy (parameter, gradient, momentum)
# takes 3 x 24 x 20 x 8 / 4 = 2880 bytes on a rank.
TOGETHER = [((24, 20), ("S0", "S1"), 1, 4, ("S0", "S0"))] * 4 + [((24, 20), ("S0", "S0"), 1, 4, None)]


def _redistributed_together(rank, world):
    """The parameters a step redistributes join their group's one library call, so that the
    owners share out all of its matrices, in runs of at most redistribution_bytes of copies."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    calls = counting_step_calls()
    for budget, per_step in [(1 << 30, [5]), (5760, [3, 2]), (0, [2, 1, 1, 1])]:
        for algorithm in ["auto", "owner"]:
            calls.clear()
            optimizer, params = steps_match_the_reference(rank, mesh, TOGETHER, 600, algorithm=algorithm,
                                                          redistribution_bytes=budget)
            assert calls == per_step * len(LEARNING_RATES), (budget, algorithm, calls)
            plan = optimizer.plan()  # with gradients: those without take no part in the owners
            owners = [plan[f"param_groups[0]['params'][{i}]"]["owner"] for i in range(len(params))]
            if algorithm == "owner" and budget == 1 << 30:  # all five in one call: shared out
                assert sorted(set(owners)) == [0, 1, 2, 3], owners
            if algorithm == "owner" and budget == 0:  # the last three alone in their calls
                assert owners[1] == owners[2] == owners[3], owners


def test_redistributed_parameters_join_their_groups_call():
    launch(_redistributed_together, 4)


# On a 2 x 2 mesh laid out [[2, 0], [3, 1]]: the pieces along tp and over the whole mesh are
# out of the groups' rank order (a process group sorts its ranks); along dp they are in order.
PERMUTED = [((45, 20), ("S0", "S0"), 1, 4, None),
            ((20, 45), ("S1", "S1"), 1, 4, None),
            ((30, 22), ("R", "S0"), 1, 2, None),
            ((26, 15), ("S0", "R"), 2, 2, None)]  # a fused weight's rows, in order along dp
# A fused weight's rows must come in order: where they do not, they are cut along columns
# instead. Only plan() is checked: DTensor's own redistribution gives wrong pieces on such a
# mesh (PyTorch 2.11: even (Shard(0), Shard(1)) to (Shard(0), Replicate())).
PERMUTED_REDISTRIBUTED = [((26, 15), ("R", "S0"), 2, 2, ("R", "S1")),
                          ((24, 17), ("S0", "S0"), 2, 4, ("S1", "S1")),
                          ((41, 35), ("S0", "S1"), 1, 4, ("S0", "S0"))]


def _permuted_mesh(rank, world):
    mesh = DeviceMesh("cpu", torch.tensor([[2, 0], [3, 1]]), mesh_dim_names=("dp", "tp"))
    steps_match_the_reference(rank, mesh, PERMUTED, 600)
    _, params, _, optimizer = parameters_of(mesh, PERMUTED_REDISTRIBUTED, 650)
    for p in params:
        p.grad = torch.zeros_like(p)
    check_plan(optimizer, params, PERMUTED_REDISTRIBUTED)


def test_a_mesh_out_of_rank_order_matches_the_whole_matrix_reference():
    launch(_permuted_mesh, 4)


# On the ("dp", "tp") half of a 2 x 2 x 2 mesh ("pp", "dp", "tp"), which does not span the
# world: without a group over dp and tp, all but the cut over tp are gathered; with the group
# DeviceMesh._flatten makes, as over the world above.
SUBMESH = {False: [((41, 35), ("S0", "S1"), 1, 2, ("R", "S1")),
                   ((45, 20), ("S0", "S0"), 1, 2, ("R", "S0")),
                   ((30, 22), ("S1", "R"), 1, 2, None)],
           True: [((41, 35), ("S0", "S1"), 1, 4, ("S0", "S0")),
                  ((45, 20), ("S0", "S0"), 1, 4, None),
                  ((30, 22), ("S1", "R"), 1, 2, None)]}


def _submesh(rank, world, flattened):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    if flattened:
        mesh["dp", "tp"]._flatten()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps_match_the_reference(rank, mesh["dp", "tp"], SUBMESH[flattened], 500)
    # Where it gathers, one warning (for both parameters) names the call that avoids it.
    notes = [str(w.message) for w in caught if "_flatten()" in str(w.message)]
    assert len(notes) == (0 if flattened else 1), notes
    if not flattened:
        assert notes[0].startswith("Muon: param_groups[0]['params'][0] (shape (41, 35)"), notes
        assert notes[0].endswith("mesh['dp', 'tp']._flatten()"), notes


@pytest.mark.parametrize("flattened", [False, True])
def test_a_submesh_uses_a_flattened_group_or_gathers(flattened):
    launch(_submesh, 8, flattened)


def _refused(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same whole tensors on every rank
    rows_over_tp = placements_of(["R", "S0"])
    good = torch.nn.Parameter(distribute(torch.randn(8, 6, dtype=torch.float64), mesh, rows_over_tp))
    # A parameter holding a partial sum (one addend per tp rank).
    partial = torch.nn.Parameter(DTensor.from_local(torch.randn(8, 6, dtype=torch.float64), mesh,
                                                    [Replicate(), Partial()], run_check=False))
    partial.grad = DTensor.from_local(torch.randn(8, 6, dtype=torch.float64), mesh, [Replicate(), Partial()],
                                      run_check=False)
    good.grad = distribute(torch.randn(8, 6, dtype=torch.float64), mesh, rows_over_tp)
    optimizer = st.Muon([good, ("layer.partial", partial)], lr=0.02)
    before = good.to_local().clone()
    with pytest.raises(ValueError, match="layer\\.partial.*placements.*mesh dimension 1 has P.*Partial"):
        optimizer.step()
    assert torch.equal(good.to_local(), before)  # nothing stepped
    # A loaded momentum of another shape on a parameter of the step's second call (its columns
    # split over dp, the first call's rows over tp; or split over both mesh dimensions, so
    # regrouped): neither call is made.
    for name, shape, codes, momentum, message in [
            ("other", (6, 10), ["S1", "R"], torch.zeros(3, 10, dtype=torch.float64), "must be"),
            ("both", (8, 10), ["S0", "S1"], torch.zeros(4, 5, dtype=torch.float64),
             "must be a torch\\.float64 DTensor")]:
        placements = placements_of(codes)
        other = torch.nn.Parameter(distribute(torch.randn(*shape, dtype=torch.float64), mesh, placements))
        other.grad = distribute(torch.randn(*shape, dtype=torch.float64), mesh, placements)
        good.grad = distribute(torch.randn(8, 6, dtype=torch.float64), mesh, rows_over_tp)
        optimizer = st.Muon([good, (f"layer.{name}", other)], lr=0.02)
        optimizer.state[other]["momentum_buffer"] = momentum
        before = good.to_local().clone()
        with pytest.raises(ValueError, match=f"layer\\.{name}.*momentum_buffer {message}"):
            optimizer.step()
        assert torch.equal(good.to_local(), before)
    # A gradient placed otherwise than its parameter.
    good.grad = distribute(torch.randn(8, 6, dtype=torch.float64), mesh, placements_of(["S0", "R"]))
    with pytest.raises(ValueError, match="its gradient is placements"):
        st.Muon([good], lr=0.02).step()
    # After the errors, a good step goes through.
    good.grad = distribute(torch.randn(8, 6, dtype=torch.float64), mesh, rows_over_tp)
    before = good.to_local().clone()
    st.Muon([good], lr=0.02).step()
    assert not torch.equal(good.to_local(), before)


def test_placements_it_cannot_take_fail_on_every_rank():
    launch(_refused, 4)


# A step over four process groups of a 2 x 2 mesh: rows over tp, columns over dp, a replicated
# matrix each rank steps on its own, and rows over the world; the last redistributed (rows
# over dp and columns over tp) and, with redistribution_bytes=0, in a run of its own.
SEVERAL_GROUPS = [((40, 33), ("R", "S0"), 1, 2, None),
                  ((27, 50), ("S1", "R"), 1, 2, None),
                  ((20, 12), ("R", "R"), 1, 1, None),
                  ((45, 20), ("S0", "S0"), 1, 4, None),
                  ((41, 35), ("S0", "S1"), 1, 4, ("S0", "S0")),
                  ((35, 41), ("S1", "S0"), 1, 4, ("S1", "S1"))]


def _state_of(optimizer, params):
    return [(p.to_local().clone(), optimizer.state[p]["momentum_buffer"].to_local().clone()
             if "momentum_buffer" in optimizer.state[p] else None) for p in params]


def _unchanged(optimizer, params, before):
    return all(torch.equal(p.to_local(), w) and (m is None or torch.equal(
        optimizer.state[p]["momentum_buffer"].to_local(), m)) for p, (w, m) in zip(params, before))


def _nonfinite_in_any_group(rank, world):
    """A NaN in any one parameter's gradient on any one rank skips every call of the step on
    every rank (or raises everywhere under "raise", nothing written), however the parameters
    fall into process groups and calls; the skipped step counts once. Before, the calls of the
    groups before the NaN's had written, and under "raise" the ranks outside its group waited
    in the next call."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    calls = counting_step_calls()
    # Without the redistributed parameters, a step reuses the last one's calls (_StepCache).
    for cases, policy, budget in [(SEVERAL_GROUPS, "skip", 1 << 30), (SEVERAL_GROUPS, "skip", 0),
                                  (SEVERAL_GROUPS, "raise", 1 << 30), (SEVERAL_GROUPS[:4], "skip", 1 << 30),
                                  (SEVERAL_GROUPS[:4], "raise", 1 << 30)]:
        _, params, grads, optimizer = parameters_of(mesh, cases, 700, nonfinite=policy,
                                                    redistribution_bytes=budget)
        assert all(p.to_local().numel() for p in params)  # every rank can hold the NaN
        for i, p in enumerate(params):  # a finite step first, to reuse its calls after
            p.grad = grads[i][0]
        optimizer.step()
        assert (optimizer._step_cache is not None) == (len(cases) == 4)
        expected_calls = 4 + (budget == 0)
        skipped = 0
        for poisoned in range(len(params)):
            for poisoned_rank in range(world):
                before = _state_of(optimizer, params)
                for i, p in enumerate(params):
                    p.grad = grads[i][1]
                    if i == poisoned and rank == poisoned_rank and p.grad.to_local().numel():
                        p.grad = grads[i][1].clone()
                        p.grad.to_local().view(-1)[0] = float("nan")
                calls.clear()
                if policy == "raise":
                    with pytest.raises(shardmuon.ShardmuonError, match="NON_FINITE"):
                        optimizer.step()
                else:
                    optimizer.step()
                    assert len(calls) == expected_calls, calls
                assert _unchanged(optimizer, params, before), (len(cases), policy, budget, poisoned,
                                                               poisoned_rank, rank)
                skipped += 1
        counts = optimizer.nonfinite_counts()
        assert counts == {"skipped_steps": skipped, "skipped_params": 0}, (len(cases), policy, budget, counts)
        before = _state_of(optimizer, params)
        for i, p in enumerate(params):
            p.grad = grads[i][2]
        optimizer.step()  # a finite step goes through
        changed = [not torch.equal(p.to_local(), w) for p, (w, _) in zip(params, before) if p.to_local().numel()]
        assert all(changed), (policy, changed)


def test_a_nonfinite_gradient_in_any_group_skips_every_call_of_the_step():
    launch(_nonfinite_in_any_group, 4)


def _one_rank_fails(rank, world):
    """A check failing on one rank only, for a parameter of a later group, ends the step on
    every rank before anything is written: on the first step (found as the shard sizes are
    exchanged) and on a later one (the calls' arguments). Before, the ranks outside the
    failing rank's first group stepped their first groups and then waited in the failing
    rank's next group until the timeout."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for failing_rank in [0, 3]:
        _, params, grads, optimizer = parameters_of(mesh, SEVERAL_GROUPS, 750)
        for first in [True, False]:
            if not first:
                for i, p in enumerate(params):
                    p.grad = grads[i][0]
                optimizer.step()
            before = _state_of(optimizer, params)
            for i, p in enumerate(params):
                p.grad = grads[i][1]
            if rank == failing_rank:  # a negative learning rate: refused here only
                optimizer.param_groups[0]["lr"] = -0.02
            with pytest.raises((ValueError, shardmuon.ShardmuonError)) as caught:
                optimizer.step()
            if rank == failing_rank:
                assert "invalid learning rate: -0.02" in str(caught.value), caught.value
            else:
                assert "rank" in str(caught.value), caught.value  # names the failed rank
            assert _unchanged(optimizer, params, before), (failing_rank, first, rank)
            optimizer.param_groups[0]["lr"] = 0.02
        for i, p in enumerate(params):
            p.grad = grads[i][2]
        optimizer.step()  # then a good step goes through


def test_a_check_failing_on_one_rank_fails_the_step_on_every_rank():
    launch(_one_rank_fails, 4)


def _state_dict(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    weight, g = random_matrices(300, (23, 31), torch.float64, 4)
    a = torch.nn.Parameter(distribute(weight, mesh, [Shard(1)]))
    optimizer = st.Muon([a], lr=0.02)
    for step in range(2):
        a.grad = distribute(g[step], mesh, [Shard(1)])
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())  # as if from a file: no tensor shared
    assert isinstance(saved["state"][0]["momentum_buffer"], DTensor)
    b = torch.nn.Parameter(DTensor.from_local(a.to_local().clone(), mesh, [Shard(1)], run_check=False,
                                              shape=a.shape, stride=a.stride()))
    resumed = st.Muon([b], lr=0.5)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        a.grad = distribute(g[step], mesh, [Shard(1)])
        b.grad = distribute(g[step], mesh, [Shard(1)])
        optimizer.step()
        resumed.step()
    assert torch.equal(a.to_local(), b.to_local())


def test_state_dict_round_trip_continues_exactly():
    launch(_state_dict, 2)


# Changes a user may make to DTensor parameters between steps, each applied alike to two
# optimizers (see _step_reuse): (opt, a, b, c, mesh).
def _swap_a_local_storage(opt, a, b, c, mesh):  # FSDP2 may give a shard new storage
    a._local_tensor.data = a._local_tensor.data.clone()


def _replace_a_momentum(opt, a, b, c, mesh):
    opt.state[a]["momentum_buffer"] = opt.state[a]["momentum_buffer"] * 0.5


def _move_a_momentum(opt, a, b, c, mesh):  # the same DTensor, its piece elsewhere
    piece = opt.state[a]["momentum_buffer"]._local_tensor
    piece.data = piece.data.clone()


def _drop_b_gradient(opt, a, b, c, mesh):
    b.grad = None


def _reload_the_state(opt, a, b, c, mesh):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def _replicated_a_gradient(opt, a, b, c, mesh):
    a.grad = a.grad.redistribute(mesh, [Replicate()])


def _replicated_a_momentum(opt, a, b, c, mesh):
    state = opt.state[a]
    state["stashed"] = state["momentum_buffer"]
    state["momentum_buffer"] = state["stashed"].redistribute(mesh, [Replicate()])


def _a_momentum_back(opt, a, b, c, mesh):
    state = opt.state[a]
    state["momentum_buffer"] = state.pop("stashed")


def _disagreeing_partition_dim(opt, a, b, c, mesh):
    a.partition_dim = 1


def _agreeing_partition_dim(opt, a, b, c, mesh):
    a.partition_dim = 0


def _new_learning_rate(opt, a, b, c, mesh):
    opt.param_groups[0]["lr"] = 0.05


def _add_c(opt, a, b, c, mesh):
    opt.param_groups[1]["params"].append(c)


def _partial_c_gradient(opt, a, b, c, mesh):  # of the replicated c's local shape: refused
    c.grad = DTensor.from_local(c.grad.to_local() / mesh.size(), mesh, [Partial()], run_check=False)


# (change, whether the step may reuse the last one's arguments, the error it must raise, and
# what undoes the change after it): see reuse.check_reuse.
_DTENSOR_CHANGES = [
    (None, False, None, None),  # the first step
    (None, True, None, None),  # new gradient DTensors of the same placements
    (reuse.gradients_in_place, True, None, None),
    (_new_learning_rate, True, None, None),
    (_swap_a_local_storage, False, None, None),
    (_replace_a_momentum, False, None, None),
    (_move_a_momentum, False, None, None),
    (_drop_b_gradient, False, None, None),
    (None, False, None, None),  # b has its gradient again
    (_reload_the_state, False, None, None),
    (None, True, None, None),
    (_replicated_a_gradient, False, (ValueError, "its gradient is placements"), None),
    (None, False, None, None),
    (_replicated_a_momentum, False, (ValueError, "momentum_buffer must be a"), _a_momentum_back),
    (None, False, None, None),
    (_disagreeing_partition_dim, False, (ValueError, "partition_dim attribute is 1"), _agreeing_partition_dim),
    (None, False, None, None),  # an agreeing attribute is a change too
    (None, True, None, None),
    (_add_c, False, None, None),
    (None, True, None, None),
    (_partial_c_gradient, False, (ValueError, r"its gradient is .*Partial"), None),
    (None, False, None, None),
    (None, True, None, None),
]


def _step_reuse(rank, world):
    """A step of the same DTensor parameters reuses the C arrays the last step built; each
    change above must be seen (see reuse.check_reuse)."""
    mesh = init_device_mesh("cpu", (world,))
    placements = [[Shard(0)], [Shard(1)], [Replicate()]]
    shapes = [(7, 5), (6, 9), (4, 4)]
    generator = torch.Generator().manual_seed(17)
    start = [torch.randn(*shape, generator=generator) for shape in shapes]
    gradients = [[torch.randn(*shape, generator=generator) for shape in shapes] for _ in _DTENSOR_CHANGES]

    def set_gradient(p, index, step, in_place):
        gradient = distribute(gradients[step][index], mesh, placements[index])
        if in_place:
            with torch.no_grad():
                p.grad.to_local().copy_(gradient.to_local())
        else:
            p.grad = gradient

    reuse.check_reuse(_DTENSOR_CHANGES,
                      lambda: [torch.nn.Parameter(distribute(w, mesh, p)) for w, p in zip(start, placements)],
                      set_gradient, DTensor.to_local, context=(mesh,))


def test_a_step_of_dtensors_reuses_the_last_steps_arguments_only_while_they_still_hold():
    launch(_step_reuse, 2)


def _newton_schulz(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    ns = st.NewtonSchulz()
    triples = reference.coefficients("quintic", 5)
    for i, (shape, placements) in enumerate([((37, 53), [Shard(0)]), ((53, 37), [Shard(1)]),
                                             ((20, 30), [Replicate()])]):
        whole, _ = random_matrices(400 + i, shape, torch.float64, 0)
        x = distribute(whole, mesh, placements)
        assert ns(x) is x
        expected = distribute(reference.newton_schulz(whole, triples, 1e-7), mesh, placements).to_local()
        assert reference.relative_error(x.to_local(), expected) < 1e-11, (rank, i)
    with pytest.raises(ValueError, match="placements give its split"):
        ns(x, partition_dim=0)
    if world == 4:  # split over two mesh dimensions: over the world's 4 ranks
        square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for i, codes in enumerate([("S0", "S1"), ("S0", "S0"), ("S1", "S0")]):
            whole, _ = random_matrices(450 + i, (29, 38), torch.float64, 0)
            x = distribute(whole, square, placements_of(codes))
            ns(x)
            expected = distribute(reference.newton_schulz(whole, triples, 1e-7), square, placements_of(codes))
            assert reference.relative_error(x.to_local(), expected.to_local()) < 1e-11, (rank, codes)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_newton_schulz_takes_a_dtensor(world):
    launch(_newton_schulz, world)


def _matrices_without_elements(rank, world):
    # DTensors with no element (a (0, n) weight split by rows, a (9, 0) one split by rows,
    # whose pieces are (3, 0) or empty, a replicated one, no experts' rows) beside one that
    # has elements, whose own rows DTensor's chunking may leave empty on a rank: the empty
    # ones are left alone on every rank, the other steps as the reference.
    mesh = init_device_mesh("cpu", (world,))
    weight, grads = random_matrices(460, (5, 12), torch.float64, len(LEARNING_RATES))
    param = torch.nn.Parameter(distribute(weight, mesh, [Shard(0)]))
    empties = [((0, 7), [Shard(0)]), ((9, 0), [Shard(0)]), ((0, 11), [Replicate()]),
               ((0, 4, 6), [Shard(0)])]
    params = [param] + [torch.nn.Parameter(distribute(torch.zeros(shape, dtype=torch.float64), mesh, placements))
                        for shape, placements in empties]
    optimizer = st.Muon(params, lr=LEARNING_RATES[0], weight_decay=0.1)
    assert list(optimizer.plan()) == ["param_groups[0]['params'][0]"]

    def grads_of(i, step):
        if i == 0:
            return distribute(grads[step], mesh, [Shard(0)])
        return torch.zeros_like(params[i])

    run_steps(optimizer, params, grads_of)
    for p in params[1:]:
        assert p not in optimizer.state or "momentum_buffer" not in optimizer.state[p], rank
    check_pieces([param], lambda i: distribute(reference_steps(weight, grads), mesh, [Shard(0)]).to_local(),
                 [torch.float64], rank)


@pytest.mark.parametrize("world", [2, 4])
def test_matrices_without_elements_are_left_alone_on_every_rank(world):
    launch(_matrices_without_elements, world)


def _distributed_checkpoint(rank, world, directory, optimizer_class):
    """The optimizer state through torch.distributed.checkpoint, as torchtitan saves it: saved
    with the rows split, loaded with the columns split (DCP reshards the DTensor momentum),
    then a step continues as if uninterrupted. Of Muon, or of TorchMuon (whose groups hold
    torch.optim.Muon's names; its iteration in float64 here, as Muon's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    mesh = init_device_mesh("cpu", (world,))
    weight, g = random_matrices(700, (26, 19), torch.float64, 3)

    def model_of(whole, placement):
        model = torch.nn.Linear(19, 26, bias=False, dtype=torch.float64)
        model.weight = torch.nn.Parameter(distribute(whole, mesh, [placement]))
        return model

    def make(params):
        options = {"ns_dtype": None} if optimizer_class == "TorchMuon" else {}
        return getattr(st, optimizer_class)(params, lr=0.02, **options)

    saver = model_of(weight, Shard(0))
    optimizer = make(saver.parameters())
    for step in range(2):
        saver.weight.grad = distribute(g[step], mesh, [Shard(0)])
        optimizer.step()
    dcp.save(get_optimizer_state_dict(saver, optimizer), checkpoint_id=directory)

    loader = model_of(saver.weight.detach().full_tensor(), Shard(1))
    resumed = make(loader.parameters())
    state = get_optimizer_state_dict(loader, resumed)  # PyTorch creates the state by a step at lr 0
    dcp.load(state, checkpoint_id=directory)
    set_optimizer_state_dict(loader, resumed, state)
    momentum = resumed.state[loader.weight]["momentum_buffer"]
    assert momentum.placements == (Shard(1),)
    assert torch.equal(momentum.full_tensor(), optimizer.state[saver.weight]["momentum_buffer"].full_tensor())

    saver.weight.grad = distribute(g[2], mesh, [Shard(0)])
    loader.weight.grad = distribute(g[2], mesh, [Shard(1)])
    optimizer.step()
    resumed.step()
    error = reference.relative_error(loader.weight.full_tensor(), saver.weight.full_tensor())
    assert error < 1e-12, (rank, error)


@pytest.mark.parametrize("optimizer_class", ["Muon", "TorchMuon"])
def test_torch_distributed_checkpoint_reshards_the_state(tmp_path, optimizer_class):
    launch(_distributed_checkpoint, 2, str(tmp_path), optimizer_class)


def fully_shard_function():
    """FSDP2's fully_shard, where this PyTorch keeps it."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def two_layer_model(hidden):
    """A float64 model of two matrices, 13 -> hidden -> 11, of the same initial weights on
    every rank, and a copy to be trained whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, hidden, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 11, bias=False)).double()
    return model, copy.deepcopy(model)


def trains_like_the_whole_model(model, whole_model, optimizer, replicas, replica, steps, rank):
    """`steps` steps of the sharded model on the batch of its data-parallel replica (of
    `replicas` random batches a step, the loss of each the mean square of the output, FSDP
    averaging their gradients) and of the float64 reference on the whole model and the mean
    of all the batches' losses: the sharded weights must end as the reference's."""
    references = [(p.detach().clone(), torch.zeros_like(p)) for p in whole_model.parameters()]
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batches = [torch.randn(8, 13, generator=generator, dtype=torch.float64) for _ in range(replicas)]
        model(batches[replica]).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        whole_model.zero_grad()
        (sum(whole_model(x).square().mean() for x in batches) / replicas).backward()
        references = [reference.muon_step(w, p.grad, m, lr=0.02, weight_decay=0.1)
                      for (w, m), p in zip(references, whole_model.parameters())]
        with torch.no_grad():  # the whole model's next forward uses the reference's weights
            for p, (w, _) in zip(whole_model.parameters(), references):
                p.copy_(w)
    for p, (w, _) in zip(model.parameters(), references):
        error = reference.relative_error(p.full_tensor(), w)
        assert error < 1e-11, (rank, tuple(p.shape), p.placements, error)


def _fsdp2(rank, world):
    """A model sharded by FSDP2 (fully_shard: every weight a Shard(0) DTensor over the mesh,
    gradients reduce-scattered by FSDP) trains with Muon like the whole model on the whole
    batch, its steps after the first reusing the first one's arguments."""
    mesh = init_device_mesh("cpu", (world,))
    model, whole_model = two_layer_model(37)
    fully_shard_function()(model, mesh=mesh)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), p
    optimizer = st.Muon(model.parameters(), lr=0.02, weight_decay=0.1)
    full_checks = reuse.count_full_checks(optimizer)
    trains_like_the_whole_model(model, whole_model, optimizer, world, rank, 3, rank)
    # FSDP2 keeps each parameter's piece and gives new gradients of the same placements: the
    # steps after the first reuse its arguments.
    assert len(full_checks) == 1, full_checks


@pytest.mark.parametrize("world", [2, 3])
def test_a_model_sharded_by_fsdp2_trains_like_the_whole_model(world):
    launch(_fsdp2, world)


def _hsdp(rank, world):
    """FSDP2 over a 2D mesh (HSDP, torchtitan's dp_replicate x dp_shard): every weight
    Replicate() over the first mesh dimension and Shard(0) over the second, its gradient
    averaged over all four ranks. Each replica group of two orthogonalizes its weights over
    its own shards, and the model trains like the whole model on the whole batch, its steps
    after the first reusing the first one's arguments."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, whole_model = two_layer_model(37)
    fully_shard_function()(model, mesh=mesh)
    for p in model.parameters():
        assert p.placements == (Replicate(), Shard(0)), p.placements
    optimizer = st.Muon(model.parameters(), lr=0.02, weight_decay=0.1)
    assert [x["group_size"] for x in optimizer.plan().values()] == [2, 2]
    full_checks = reuse.count_full_checks(optimizer)
    trains_like_the_whole_model(model, whole_model, optimizer, world, rank, 3, rank)
    assert len(full_checks) == 1, full_checks


def test_hsdp_trains_like_the_whole_model():
    launch(_hsdp, 4)


def _fsdp2_with_tensor_parallelism(rank, world):
    """torchtitan's 2D parallelism: tensor parallelism (a column-parallel then a row-parallel
    layer) on the mesh's "tp" dimension, FSDP2 on its "dp" dimension. The weights are then
    split over both (a strided shard and Shard(0) for the first, Shard(0) and Shard(1) for the
    second): Muon steps them over all four ranks and trains like the whole model on the whole
    batch."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # The hidden width is even: PyTorch's row-parallel layer rebuilds its input's DTensor
    # assuming even pieces (37 over 2 fails in its sharding propagation). FSDP2's pieces of
    # the second weight's 11 rows are still uneven.
    model, whole_model = two_layer_model(36)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard_function()(model, mesh=mesh["dp"])
    for p in model.parameters():
        assert len(p.placements) == 2 and not any(x.is_replicate() for x in p.placements), p.placements
    optimizer = st.Muon(model.parameters(), lr=0.02, weight_decay=0.1)
    # Both are stepped over all 4 ranks: the first weight's rows as they are, the second's
    # redistributed to rows.
    plan = list(optimizer.plan().values())
    assert [(x["group_size"], x["redistributed"]) for x in plan] == [(4, None), (4, (Shard(0), Shard(0)))], plan
    calls = counting_step_calls()
    trains_like_the_whole_model(model, whole_model, optimizer, 2, mesh["dp"].get_local_rank(), 2, rank)
    assert calls == [2, 2], calls  # both weights in one call a step


def test_fsdp2_with_tensor_parallelism_trains_like_the_whole_model():
    launch(_fsdp2_with_tensor_parallelism, 4)
