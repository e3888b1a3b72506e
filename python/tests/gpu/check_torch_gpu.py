"""GPU checks of shardmuon.torch (PyTorch 2.x on the lent machine; CI has no GPU).

    torchrun --nproc_per_node=2 python/tests/gpu/check_torch_gpu.py   # sharded, NCCL
    torchrun --nproc_per_node=2 --no-python scripts/rank_host_id.sh python3 \
        python/tests/gpu/check_torch_gpu.py                           # the same, sharing one GPU
    python3 python/tests/gpu/check_torch_gpu.py                       # one GPU (or torchrun with 1)
    torchrun --nproc_per_node=4 [--no-python scripts/rank_host_id.sh python3] \
        python/tests/gpu/check_torch_gpu.py                           # a 2 x 2 mesh (mesh_checks)

On 2 ranks (2 GPUs, or sharing one): every sharding mode (rows, columns, uneven, replicated)
and dtype for 3 steps with the learning rate changed every step, against the float64
reference on the whole matrices; a parameter without gradient; the errors for a CPU/CUDA mix
and for a gloo group.
On 1 GPU: against torch.optim.Muon where the settings coincide, and TorchMuon against it
given the same arguments, its state dict loaded into TorchMuon; MuonWithAdamW's fused AdamW;
torch.amp.GradScaler's protocol against its ordinary path. On both: DTensor parameters
and NewtonSchulz on a DTensor, on a CUDA device mesh of every rank (rows and columns split by
DTensor's own chunking, replicated, and an expert stack's rows), against the reference;
MuonWithAdamW and GradScaler over DTensors; non-finite gradients on one rank.
Prints one line per check and a summary; exits 1 if any failed.
"""

import copy
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.join(os.path.dirname(__file__), ".."), os.path.join(os.path.dirname(__file__), "..", "..")]
import reference  # noqa: E402
from processes import shard_of, split  # noqa: E402
import shardmuon  # noqa: E402
import shardmuon.torch as st  # noqa: E402

results = []


def record(name, ok, detail=""):
    results.append(ok)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def sharded_checks(rank, world, device):
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
    lrs = [0.02, 0.05, 0.01]
    for rows, cols in [(384, 1152), (1152, 384), (257, 131)]:
        for dim in (0, 1, -1):
            for dtype in (torch.float32, torch.bfloat16):
                for weights in ([1, 1], [3, 1]):
                    generator = torch.Generator().manual_seed(rows + cols + dim)
                    whole = (0.05 * torch.randn(rows, cols, generator=generator, dtype=torch.float64)).to(dtype)
                    grads = [torch.randn(rows, cols, generator=generator, dtype=torch.float64).to(dtype) for _ in lrs]
                    sizes = split(rows if dim == 0 else cols, weights) if dim != -1 else None
                    p = torch.nn.Parameter(shard_of(whole, dim, sizes, rank).to(device))
                    p.partition_dim = dim
                    optimizer = st.Muon([p], lr=lrs[0], weight_decay=0.1, process_group=dist.group.WORLD)
                    w_ref, m_ref = whole.double(), torch.zeros(rows, cols, dtype=torch.float64)
                    for step, lr in enumerate(lrs):
                        optimizer.param_groups[0]["lr"] = lr
                        p.grad = shard_of(grads[step], dim, sizes, rank).to(device)
                        optimizer.step()
                        w_ref, m_ref = reference.muon_step(w_ref, grads[step], m_ref, lr=lr, weight_decay=0.1)
                    expected = shard_of(w_ref, dim, sizes, rank)
                    error = torch.tensor(reference.relative_error(p.detach().cpu(), expected), device=device)
                    dist.all_reduce(error, op=dist.ReduceOp.MAX)
                    record(f"{rows}x{cols} partition_dim={dim} {str(dtype)[6:]} shards={sizes}",
                           error.item() < tolerance[dtype],
                           f"error {error.item():.2e} (tolerance {tolerance[dtype]:.0e})")

    # A step captured with torch.cuda.graph after one uncaptured step, replayed with new
    # gradients copied into the same tensors; a dim-0 shard and a flat (ZeRO-style) one. With a
    # float lr the graph replays the captured rate; with a float32 tensor lr the kernels read
    # it when they run, so a schedule filled in between replays takes effect.
    generator = torch.Generator().manual_seed(5)
    shapes = [(384, 1152), (96, 200)]
    wholes = [(0.05 * torch.randn(r, c, generator=generator, dtype=torch.float64)).float() for r, c in shapes]
    grads = [[torch.randn(r, c, generator=generator, dtype=torch.float64).float() for _ in range(3)]
             for r, c in shapes]
    row_sizes = split(384, [3, 1])
    flat_sizes = split(96 * 200, [3, 1])
    flat_start = sum(flat_sizes[:rank])

    def pieces(i, x):
        if i == 0:
            return shard_of(x, 0, row_sizes, rank).to(device)
        return x.reshape(-1)[flat_start:flat_start + flat_sizes[rank]].clone().to(device)

    def check_captured(name, rates, tensor_lr):
        params = [torch.nn.Parameter(pieces(i, w)) for i, w in enumerate(wholes)]
        params[0].partition_dim = 0
        params[1].partition_dim = "flat"
        params[1].muon_shape = shapes[1]
        lr = torch.tensor(rates[0], dtype=torch.float32, device=device) if tensor_lr else rates[0]
        optimizer = st.Muon(params, lr=lr, weight_decay=0.1, process_group=dist.group.WORLD)
        for i, p in enumerate(params):
            p.grad = pieces(i, grads[i][0])
        optimizer.step()
        try:
            graph = torch.cuda.CUDAGraph()
            for step in (1, 2):
                for i, p in enumerate(params):
                    p.grad.copy_(pieces(i, grads[i][step]))
                if tensor_lr:
                    lr.fill_(rates[step])
                if step == 1:
                    with torch.cuda.graph(graph):
                        optimizer.step()
                graph.replay()
                torch.cuda.synchronize()
            worst = 0.0
            for i, p in enumerate(params):
                w_ref, m_ref = wholes[i].double(), torch.zeros(shapes[i], dtype=torch.float64)
                for step in range(3):
                    w_ref, m_ref = reference.muon_step(w_ref, grads[i][step], m_ref, lr=rates[step],
                                                       weight_decay=0.1)
                worst = max(worst, reference.relative_error(p.detach().cpu(), pieces(i, w_ref).cpu()))
            error = torch.tensor(worst, device=device)
            dist.all_reduce(error, op=dist.ReduceOp.MAX)
            record(name, error.item() < 2e-5, f"error {error.item():.2e}")
        except Exception as failure:  # noqa: BLE001 (the check reports any failure)
            record(name, False, f"({failure})")

    check_captured("a step captured with torch.cuda.graph replays like uncaptured steps",
                   [0.02, 0.02, 0.02], tensor_lr=False)
    check_captured("a captured step with a tensor lr follows the rate filled in between replays",
                   [0.02, 0.05, 0.01], tensor_lr=True)

    # A parameter without gradient on every rank is skipped.
    p = torch.nn.Parameter(torch.randn(64, 32, device=device))
    p.partition_dim = 0
    q = torch.nn.Parameter(torch.randn(64, 32, device=device))
    q.partition_dim = 1
    before = q.detach().clone()
    optimizer = st.Muon([p, q], lr=0.02, process_group=dist.group.WORLD)
    p.grad = torch.randn_like(p)
    optimizer.step()
    record("a parameter without gradient is skipped",
           torch.equal(q, before) and "momentum_buffer" not in optimizer.state[q])

    # MuonWithAdamW: a NaN in an AdamW gradient on the last rank only skips Muon and AdamW on
    # every rank (the step flag in GPU memory, all-reduced by the Muon step); the next finite
    # step runs both.
    weight = torch.nn.Parameter(torch.randn(96, 40, device=device))
    weight.partition_dim = 1
    bias = torch.nn.Parameter(torch.randn(40, device=device))
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-3}], lr=0.02,
                                 process_group=dist.group.WORLD)
    weight.grad, bias.grad = torch.randn_like(weight), torch.ones_like(bias)
    if rank == world - 1:
        bias.grad[3] = float("nan")
    before = [weight.detach().clone(), bias.detach().clone()]
    optimizer.step()
    skipped = torch.equal(weight, before[0]) and torch.equal(bias, before[1])
    counts = optimizer.nonfinite_counts()
    bias.grad = torch.ones_like(bias)
    optimizer.step()
    stepped = not torch.equal(weight, before[0]) and not torch.equal(bias, before[1])
    every_rank = torch.tensor(float(skipped and stepped and counts == {"skipped_steps": 1, "skipped_params": 0}),
                              device=device)
    dist.all_reduce(every_rank, op=dist.ReduceOp.MIN)
    record(f"MuonWithAdamW: a NaN AdamW gradient on rank {world - 1} skips both everywhere, then both step",
           every_rank.item() == 1.0, f"rank 0's counts {counts}")

    # A loss scaler's found_inf on the first rank only (its shard overflowed) skips the step on
    # every rank (GradScaler's own path would step the others; see loss_scaler_checks).
    weight = torch.nn.Parameter(torch.randn(96, 40, device=device))
    weight.partition_dim = 0
    optimizer = st.Muon([weight], lr=0.02, process_group=dist.group.WORLD)
    weight.grad = torch.randn_like(weight)
    before = weight.detach().clone()
    optimizer.grad_scale = torch.tensor(4.0, device=device)
    optimizer.found_inf = torch.tensor(1.0 if rank == 0 else 0.0, device=device)
    optimizer.step()
    del optimizer.grad_scale, optimizer.found_inf
    every_rank = torch.tensor(float(torch.equal(weight, before)), device=device)
    dist.all_reduce(every_rank, op=dist.ReduceOp.MIN)
    record("Muon: a loss scaler's found_inf on rank 0 alone skips the step everywhere", every_rank.item() == 1.0)

    # Bad input: a CPU and a CUDA parameter; CUDA parameters with a gloo group.
    cpu = torch.nn.Parameter(torch.randn(8, 8))
    cpu.grad = torch.randn(8, 8)
    cpu.partition_dim = -1
    gpu = torch.nn.Parameter(torch.randn(8, 8, device=device))
    gpu.grad = torch.randn(8, 8, device=device)
    gpu.partition_dim = -1
    try:
        st.Muon([cpu, gpu], process_group=dist.group.WORLD).step()
        record("CPU/CUDA mix raises", False)
    except ValueError as error:
        record("CPU/CUDA mix raises", "one device" in str(error), f"({error})")
    gloo = dist.new_group(backend="gloo")
    try:
        st.Muon([gpu], process_group=gloo).step()
        record("gloo group with CUDA tensors raises", False)
    except ValueError as error:
        record("gloo group with CUDA tensors raises", "NCCL" in str(error), f"({error})")


def dtensor_checks(rank, world, device):
    """DTensor parameters on a 1D CUDA mesh over NCCL (on one GPU, a mesh of one rank). An
    expert stack with every expert's rows split is redistributed to columns first (DTensor's
    all-to-all over NCCL) on several GPUs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (world,))
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
    lrs = [0.02, 0.05, 0.01]
    cases = [((257, 131), Shard(0), torch.bfloat16), ((131, 257), Shard(1), torch.float32),
             ((384, 1152), Shard(1), torch.bfloat16), ((96, 64), Replicate(), torch.float32),
             ((4, 96, 160), Shard(1), torch.float32)]
    params, wholes = [], []
    for i, (shape, placement, dtype) in enumerate(cases):
        generator = torch.Generator().manual_seed(500 + i)
        whole = (0.05 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)
        grads = [torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype) for _ in lrs]
        params.append(torch.nn.Parameter(distribute_tensor(whole.to(device), mesh, [placement])))
        wholes.append((whole, grads))
    optimizer = st.Muon(params, lr=lrs[0], weight_decay=0.1)
    for step, lr in enumerate(lrs):
        optimizer.param_groups[0]["lr"] = lr
        for p, (_, grads) in zip(params, wholes):
            p.grad = distribute_tensor(grads[step].to(device), mesh, p.placements)
        optimizer.step()
    for p, (shape, placement, dtype), (whole, grads) in zip(params, cases, wholes):
        expected = reference.muon_steps(whole, grads, lrs, weight_decay=0.1)
        error = reference.relative_error(p.full_tensor().cpu(), expected)
        record(f"DTensor {'x'.join(map(str, shape))} {placement} {str(dtype)[6:]} on {world} rank(s), rank 0's "
               f"piece {tuple(p.to_local().shape)}", error < tolerance[dtype],
               f"error {error:.2e} (tolerance {tolerance[dtype]:.0e})")
    # MuonWithAdamW over DTensor parameters (its AdamW then not fused: the verdict read on the
    # host): a NaN in the last rank's piece of the replicated bias's gradient skips both
    # everywhere; then both step, the bias as torch's AdamW on the plain tensor.
    generator = torch.Generator().manual_seed(700)
    weight_whole = torch.randn(96, 160, generator=generator).to(device)
    weight = torch.nn.Parameter(distribute_tensor(weight_whole, mesh, [Shard(1)]))
    bias_whole = torch.randn(160, generator=generator).to(device)
    bias = torch.nn.Parameter(distribute_tensor(bias_whole, mesh, [Replicate()]))
    plain_bias = torch.nn.Parameter(bias_whole.clone())
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-3}], lr=0.02)
    plain = torch.optim.AdamW([plain_bias], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    weight.grad = distribute_tensor(torch.randn(96, 160, generator=generator).to(device), mesh, [Shard(1)])
    bias_grad = torch.randn(160, generator=generator).to(device)
    bias.grad = distribute_tensor(bias_grad.clone(), mesh, [Replicate()])  # on one rank, not a copy
    if rank == world - 1:
        bias.grad.to_local()[2] = float("nan")
    before = [weight.full_tensor().clone(), bias.to_local().clone()]
    optimizer.step()
    skipped = torch.equal(weight.full_tensor(), before[0]) and torch.equal(bias.to_local(), before[1])
    bias.grad = distribute_tensor(bias_grad.clone(), mesh, [Replicate()])
    optimizer.step()
    plain_bias.grad = bias_grad.clone()
    plain.step()
    error = reference.relative_error(bias.to_local().cpu().double(), plain_bias.detach().cpu().double())
    every_rank = torch.tensor(float(skipped and not torch.equal(weight.full_tensor(), before[0]) and error < 1e-6),
                              device=device)
    dist.all_reduce(every_rank, op=dist.ReduceOp.MIN)
    record(f"MuonWithAdamW over DTensors on {world} rank(s): a NaN on rank {world - 1} skips both, then both step",
           every_rank.item() == 1.0, f"fused {optimizer._adam.param_groups[0].get('fused')}, bias error {error:.1e}")

    # GradScaler over DTensor parameters (float16 autocast): the protocol against the scaler's
    # ordinary path, an overflow on every rank at step 2 (on one rank only, the ordinary path
    # would call step() on the others alone).
    runs = {}
    for protocol in (True, False):
        generator = torch.Generator().manual_seed(800)
        w1 = torch.nn.Parameter(distribute_tensor((0.1 * torch.randn(96, 64, generator=generator)).to(device),
                                                  mesh, [Shard(0)]))
        w2 = torch.nn.Parameter(distribute_tensor((0.1 * torch.randn(32, 96, generator=generator)).to(device),
                                                  mesh, [Shard(1)]))
        optimizer = st.Muon([w1, w2], lr=0.02)
        optimizer._step_supports_amp_scaling = protocol
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
        for step in range(5):
            x = torch.randn(8, 64, generator=generator).to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                y = torch.nn.functional.linear(torch.nn.functional.linear(x, w1.full_tensor()), w2.full_tensor())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(y.float().square().mean()).backward()
            if step == 2:
                w1.grad.to_local()[0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        runs[protocol] = ([w1.full_tensor(), w2.full_tensor()], scaler.get_scale(), optimizer.nonfinite_counts())
    same = all(torch.equal(a, b) for a, b in zip(runs[True][0], runs[False][0])) and runs[True][1] == runs[False][1]
    every_rank = torch.tensor(float(same and runs[True][2]["skipped_steps"] == 1), device=device)
    dist.all_reduce(every_rank, op=dist.ReduceOp.MIN)
    record(f"GradScaler over DTensors on {world} rank(s): the protocol steps as its ordinary path, overflow included",
           every_rank.item() == 1.0, f"scale {runs[True][1]} vs {runs[False][1]}, counts {runs[True][2]}")

    ns = st.NewtonSchulz()
    generator = torch.Generator().manual_seed(600)
    whole = torch.randn(333, 1000, generator=generator, dtype=torch.float64)
    x = distribute_tensor(whole.float().to(device), mesh, [Shard(1)])
    ns(x)
    expected = reference.newton_schulz(whole, reference.coefficients("quintic", 5), 1e-7)
    error = reference.relative_error(x.full_tensor().cpu(), expected)
    record(f"NewtonSchulz of a 333x1000 float32 DTensor Shard(1) on {world} rank(s)", error < 2e-5,
           f"error {error:.2e}")


def mesh_checks(rank, world, device):
    """On a 2 x 2 CUDA mesh (4 ranks, or 4 sharing one GPU): parameters over four process
    groups (rows over tp, columns over dp, replicated, rows over the world and, redistributed,
    rows over dp with columns over tp), so one library call per group and the step flag summed
    over each group before the first (shardmuon_context_reduce_step_flag, over NCCL). A NaN in
    the last call's gradient on one rank skips every call on every rank, counted once; under
    "raise" every rank raises; a check failing on one rank fails every rank; nothing written.
    Then a finite step against the float64 reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = [((257, 131), (Replicate(), Shard(0)), torch.bfloat16),
             ((131, 257), (Shard(1), Replicate()), torch.float32),
             ((96, 64), (Replicate(), Replicate()), torch.float32),
             ((384, 160), (Shard(0), Shard(0)), torch.bfloat16),
             ((200, 120), (Shard(0), Shard(1)), torch.float32)]
    wholes = []
    for i, (shape, placements, dtype) in enumerate(cases):
        generator = torch.Generator().manual_seed(800 + i)
        whole = (0.05 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)
        wholes.append((whole, torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)))

    def fresh(nonfinite):
        params = [torch.nn.Parameter(distribute_tensor(whole.to(device), mesh, list(placements)))
                  for (whole, _), (_, placements, _) in zip(wholes, cases)]
        return params, st.Muon(params, lr=0.02, weight_decay=0.1, nonfinite=nonfinite)

    def give(params, poison=None):
        for i, (p, (_, grad)) in enumerate(zip(params, wholes)):
            p.grad = distribute_tensor(grad.to(device), mesh, list(p.placements))
            if poison == (i, rank):
                p.grad.to_local().view(-1)[0] = float("nan")

    def every_rank(ok):
        flag = torch.tensor(float(ok), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return flag.item() == 1.0

    params, optimizer = fresh("skip")
    before = [p.to_local().clone() for p in params]
    give(params, poison=(3, 0))  # rows over the world: the last call's group
    optimizer.step()
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(params, before))
    counts = optimizer.nonfinite_counts()
    record("2 x 2 mesh: a NaN on rank 0 in the last of 4 calls' gradients skips every call on every rank, "
           "counted once", every_rank(unchanged and counts["skipped_steps"] == 1), str(counts))
    give(params)
    optimizer.step()
    errors = []
    for p, (whole, grad), (_, _, dtype) in zip(params, wholes, cases):
        expected = reference.muon_steps(whole, [grad], [0.02], weight_decay=0.1)
        errors.append(reference.relative_error(p.full_tensor().cpu(), expected) / (3e-2 if dtype == torch.bfloat16
                                                                                   else 2e-5))
    record("2 x 2 mesh: then a finite step matches the float64 reference", every_rank(max(errors) < 1),
           f"largest error/tolerance {max(errors):.2f}")
    params, optimizer = fresh("raise")
    before = [p.to_local().clone() for p in params]
    give(params, poison=(1, 3))  # columns over dp: the second call's group
    try:
        optimizer.step()
        raised = False
    except shardmuon.ShardmuonError as error:
        raised = "NON_FINITE" in str(error)
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(params, before))
    record("2 x 2 mesh, nonfinite='raise': a NaN on rank 3 raises on every rank, nothing written",
           every_rank(raised and unchanged))
    give(params)
    if rank == 2:
        optimizer.param_groups[0]["lr"] = -0.02
    try:
        optimizer.step()
        message = ""
    except (ValueError, shardmuon.ShardmuonError) as error:
        message = str(error)
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(params, before))
    record("2 x 2 mesh: a check failing on rank 2 (a negative lr) fails every rank, nothing written",
           every_rank(bool(message) and unchanged), message[:100] if rank == 0 else "")


def single_gpu_checks(device):
    """Against torch.optim.Muon where the settings coincide: its defaults' Newton-Schulz
    (3.4445, -4.7750, 2.0315) x 5 is our 'simple' schedule, its adjust_lr_fn=None ('original':
    lr * sqrt(max(1, rows / cols))) our 'shape_scaling', and its weight decay is decoupled."""
    if not hasattr(torch.optim, "Muon"):
        record("torch.optim.Muon comparison", False, "(this PyTorch has no torch.optim.Muon)")
        return
    for rows, cols in [(1024, 3072), (3072, 1024), (777, 513)]:
        for dtype in (torch.bfloat16, torch.float32):
            generator = torch.Generator().manual_seed(rows)
            w0 = (0.05 * torch.randn(rows, cols, generator=generator)).to(dtype)
            grads = [torch.randn(rows, cols, generator=generator).to(dtype) for _ in range(3)]
            ours = torch.nn.Parameter(w0.clone().to(device))
            theirs = torch.nn.Parameter(w0.clone().to(device))
            opt_ours = st.Muon([ours], lr=0.02, weight_decay=0.1, coefficient_type="simple", num_ns_steps=5,
                               scale_mode="shape_scaling")
            opt_theirs = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                          ns_steps=5, eps=1e-7)
            w_ref, m_ref = w0.double(), torch.zeros(rows, cols, dtype=torch.float64)
            for g in grads:
                ours.grad = g.to(device)
                theirs.grad = g.to(device)
                opt_ours.step()
                opt_theirs.step()
                w_ref, m_ref = reference.muon_step(w_ref, g, m_ref, lr=0.02, weight_decay=0.1, schedule="simple",
                                                   scale_mode="shape_scaling")
            update_ref = w_ref - w0.double()
            ours_error = reference.relative_error(ours.detach().double().cpu() - w0.double(), update_ref)
            theirs_error = reference.relative_error(theirs.detach().double().cpu() - w0.double(), update_ref)
            between = reference.relative_error(ours.detach().double().cpu() - w0.double(),
                                               theirs.detach().double().cpu() - w0.double())
            # float32 parameters: ours is float32 throughout, torch's Newton-Schulz runs in bf16, so
            # the two differ by torch's bf16 error. bf16 parameters: three steps' updates are
            # dominated by the rounding of W itself to bf16, independently in each optimizer, so
            # the check is that ours is no further from the float64 update than torch's.
            ok = between < 2e-2 and ours_error < 1e-4 if dtype == torch.float32 else ours_error <= theirs_error
            record(f"vs torch.optim.Muon {rows}x{cols} {str(dtype)[6:]}", ok,
                   f"update error vs float64: ours {ours_error:.2e}, torch.optim.Muon {theirs_error:.2e}; "
                   f"between them {between:.2e}")


def torch_muon_checks(device):
    """TorchMuon against torch.optim.Muon given the same arguments, float32 weights: both
    orthogonalize in bf16 (TorchMuon's default ns_dtype), so ours must be no further from the
    float64 step than torch's, within a quarter. Then a torch.optim.Muon state dict loaded into
    TorchMuon, and TorchMuon's into a torch.optim.Muon: the next step's momentum must be the
    other's to float32 rounding, and its update as close to the other's as two bf16
    iterations are (the first check's "between", within 4x)."""
    if not hasattr(torch.optim, "Muon"):
        record("TorchMuon against torch.optim.Muon", False, "(this PyTorch has no torch.optim.Muon)")
        return
    for (rows, cols), adjust_lr_fn in [((1024, 3072), None), ((3072, 1024), "match_rms_adamw"),
                                       ((777, 513), "original")]:
        generator = torch.Generator().manual_seed(cols)
        w0 = 0.05 * torch.randn(rows, cols, generator=generator)
        grads = [torch.randn(rows, cols, generator=generator) for _ in range(5)]
        arguments = dict(lr=0.02, weight_decay=0.1, ns_steps=5, adjust_lr_fn=adjust_lr_fn)
        ours = torch.nn.Parameter(w0.clone().to(device))
        theirs = torch.nn.Parameter(w0.clone().to(device))
        opt_ours, opt_theirs = st.TorchMuon([ours], **arguments), torch.optim.Muon([theirs], **arguments)
        scale_mode, extra = ("spectral", 0.2) if adjust_lr_fn == "match_rms_adamw" else ("shape_scaling", 1.0)
        w_ref, m_ref = w0.double(), torch.zeros(rows, cols, dtype=torch.float64)
        for g in grads[:3]:
            ours.grad, theirs.grad = g.to(device), g.to(device)
            opt_ours.step()
            opt_theirs.step()
            w_ref, m_ref = reference.muon_step(w_ref, g, m_ref, lr=0.02, weight_decay=0.1, schedule="simple",
                                               scale_mode=scale_mode, extra=extra)
        update = w_ref - w0.double()
        ours_error = reference.relative_error(ours.detach().double().cpu() - w0.double(), update)
        theirs_error = reference.relative_error(theirs.detach().double().cpu() - w0.double(), update)
        between = reference.relative_error(ours.detach().double().cpu() - w0.double(),
                                           theirs.detach().double().cpu() - w0.double())
        record(f"TorchMuon vs torch.optim.Muon {rows}x{cols} float32 adjust_lr_fn={adjust_lr_fn}",
               ours_error <= 1.25 * theirs_error,
               f"update error vs float64: ours {ours_error:.2e}, torch.optim.Muon {theirs_error:.2e}; "
               f"between them {between:.2e}")
        # torch.optim.Muon's state loaded into a TorchMuon, then TorchMuon's into a torch.optim.Muon
        # (which reads its own keys), each over a copy of the other's weights.
        resumed, opt_resumed = resumed_from(theirs, opt_theirs, st.TorchMuon)
        momentum, step = one_more_step((theirs, opt_theirs), (resumed, opt_resumed), grads[3].to(device))
        record(f"torch.optim.Muon's state dict into TorchMuon {rows}x{cols}", momentum < 1e-6 and step < 4 * between,
               f"next step's momentum {momentum:.2e} and update {step:.2e} from torch.optim.Muon's")
        back, opt_back = resumed_from(resumed, opt_resumed, torch.optim.Muon)
        momentum, step = one_more_step((resumed, opt_resumed), (back, opt_back), grads[4].to(device))
        record(f"TorchMuon's state dict into torch.optim.Muon {rows}x{cols}", momentum < 1e-6 and step < 4 * between,
               f"next step's momentum {momentum:.2e} and update {step:.2e} from TorchMuon's")


def muon_with_adamw_checks(device):
    """MuonWithAdamW on one GPU: its AdamW is torch's fused one, skipped on the device when a
    gradient is not finite (its step counts and moments untouched), and otherwise the same as
    a fused torch.optim.AdamW given the finite steps only."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(64, 48, generator=generator).to(device))
    bias = torch.nn.Parameter(torch.randn(48, generator=generator).to(device))
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-3}], lr=0.02)
    twin_bias = torch.nn.Parameter(bias.detach().clone())
    twin = torch.optim.AdamW([twin_bias], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    grads = [torch.randn(48, generator=generator).to(device) for _ in range(3)]
    unchanged = True
    for step, grad in enumerate(grads):
        weight.grad, bias.grad = torch.randn(64, 48, generator=generator).to(device), grad.clone()
        if step == 1:
            bias.grad[5] = float("inf")
            kept = [weight.detach().clone(), bias.detach().clone()] + [
                v.clone() for v in optimizer.state[bias].values()]
            optimizer.step()
            now = [weight.detach(), bias.detach()] + list(optimizer.state[bias].values())
            unchanged = all(torch.equal(a, b) for a, b in zip(now, kept))
            continue
        optimizer.step()
        twin_bias.grad = grad.clone()
        twin.step()
    fused = all(g["fused"] for g in optimizer._adam.param_groups)
    counts = optimizer.nonfinite_counts()
    record("MuonWithAdamW: fused AdamW skipped on the GPU by an Inf, then as torch's fused AdamW",
           fused and unchanged and torch.equal(bias, twin_bias) and counts["skipped_steps"] == 1,
           f"fused {fused}, untouched {unchanged}, counts {counts}")
    # Its state dict mapped to the CPU (torch.load(map_location="cpu"), or a foreach AdamW's
    # CPU step counts) loads into a new one, which then steps as the original does.
    saved = {"state": {k: {n: v.cpu() if torch.is_tensor(v) else v for n, v in entry.items()}
                       for k, entry in optimizer.state_dict()["state"].items()},
             "param_groups": optimizer.state_dict()["param_groups"]}
    resumed_weight = torch.nn.Parameter(weight.detach().clone())
    resumed_bias = torch.nn.Parameter(bias.detach().clone())
    resumed = st.MuonWithAdamW([{"params": [resumed_weight], "use_muon": True},
                                {"params": [resumed_bias], "use_muon": False, "lr": 1e-3}], lr=0.02)
    try:
        resumed.load_state_dict(saved)
        g = torch.randn(64, 48, generator=generator).to(device), torch.randn(48, generator=generator).to(device)
        for p, q, pair in ((weight, bias, optimizer), (resumed_weight, resumed_bias, resumed)):
            p.grad, q.grad = g[0].clone(), g[1].clone()
            pair.step()
        ok, detail = torch.equal(weight, resumed_weight) and torch.equal(bias, resumed_bias), ""
    except Exception as failure:  # noqa: BLE001 (the check reports any failure)
        ok, detail = False, f"({failure})"
    record("MuonWithAdamW: a state dict mapped to the CPU resumes the fused AdamW bit for bit", ok, detail)
    # A float16 AdamW parameter whose finite gradient's 1-norm passes float16's range (100 x
    # 1000 > 65504; AdamW's second moment, 0.05 x 1000^2, stays within it) steps; one NaN
    # among gradients of every dtype is found (the CUDA _foreach_norm path).
    half = torch.nn.Parameter(torch.zeros(100, dtype=torch.float16, device=device))
    halves = st.MuonWithAdamW([{"params": [torch.nn.Parameter(weight.detach().clone())], "use_muon": True},
                               {"params": [half], "use_muon": False, "lr": 1e-3}], lr=0.02)
    halves.param_groups[0]["params"][0].grad = torch.randn(64, 48, generator=generator).to(device)
    half.grad = torch.full((100,), 1000.0, dtype=torch.float16, device=device)
    halves.step()
    moved = torch.allclose(half.detach().float(), torch.full((100,), -1e-3, device=device), rtol=1e-2)
    finite = [torch.full((3,), 30000.0, dtype=torch.float16, device=device),
              torch.ones(1000, dtype=torch.bfloat16, device=device), torch.ones(1000, device=device),
              torch.full((3,), 1e39, dtype=torch.float64, device=device)]
    found = []
    for index in range(len(finite)):
        tensors = [t.clone() for t in finite]
        tensors[index][-1] = float("nan")
        found.append(st._any_nonfinite(tensors, device).item())
    clean = st._any_nonfinite(finite, device).item()
    record("MuonWithAdamW: a float16 gradient past float16's range steps; a NaN of any dtype is found",
           moved and halves.nonfinite_counts()["skipped_steps"] == 0 and clean == 0.0 and found == [1.0] * 4,
           f"moved {moved}, counts {halves.nonfinite_counts()}, finite {clean}, NaN {found}")


def loss_scaler_checks(device):
    """torch.amp.GradScaler with float16 autocast: through the optimizer's protocol
    (_step_supports_amp_scaling: the step unscales and skips on the device) against the same
    scaler's ordinary path (unscale_, found_inf read on the host, step() skipped): the same
    weights and scale after steps that include overflows and clipping after unscale_, and the
    protocol's steps wait for nothing (under torch.cuda.set_sync_debug_mode("warn") a
    synchronizing call warns). Then a CPU AdamW group added to a fused AdamW's optimizer: it
    steps, and a NaN in its gradient skips the CUDA parameters too."""
    runs = {}
    for protocol in (True, False):
        torch.manual_seed(4)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32)).to(device)
        optimizer = st.MuonWithAdamW(st.muon_param_groups(model, muon_lr=0.02, adamw_lr=1e-3))
        optimizer._step_supports_amp_scaling = protocol
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=3)
        synced = []
        for step in range(8):
            x = torch.randn(16, 64, device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if step == 4:
                model[0].bias.grad[0] = float("inf")  # an overflow in an AdamW gradient
            if step == 6:
                model[2].weight.grad[1, 1] = float("nan")  # and in a Muon one
            if step in (3, 6):  # gradients clipped after unscale_: the step gets no grad_scale
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn" if step >= 2 else "default")
                try:
                    scaler.step(optimizer)
                    scaler.update()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            if step >= 2 and any("synchroniz" in str(w.message) for w in caught):
                synced.append(step)
        runs[protocol] = ([p.detach().clone() for p in model.parameters()], scaler.get_scale(),
                          optimizer.nonfinite_counts(), synced)
    ours, theirs = runs[True], runs[False]
    same = all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0])) and ours[1] == theirs[1]
    record("GradScaler: the protocol steps as the scaler's ordinary path, overflows included",
           same and ours[2]["skipped_steps"] == 2, f"scale {ours[1]} vs {theirs[1]}, counts {ours[2]}")
    record("GradScaler: the protocol's steps do not synchronize (the ordinary path's do)",
           not ours[3] and bool(theirs[3]), f"synchronized at steps {ours[3]} vs {theirs[3]}")

    weight = torch.nn.Parameter(torch.randn(32, 24, device=device))
    bias = torch.nn.Parameter(torch.randn(24, device=device))
    optimizer = st.MuonWithAdamW([{"params": [weight], "use_muon": True},
                                  {"params": [bias], "use_muon": False, "lr": 1e-3}], lr=0.02)
    on_cpu = torch.nn.Parameter(torch.randn(7))
    optimizer.add_param_group({"params": [on_cpu], "use_muon": False, "lr": 1e-3})
    weight.grad, bias.grad, on_cpu.grad = torch.randn_like(weight), torch.randn_like(bias), torch.randn(7)
    kept = on_cpu.detach().clone()
    try:
        optimizer.step()
        ok, detail = not torch.equal(on_cpu, kept), ""
        # A NaN in the CPU gradient skips the CUDA Muon step too (the check moved to its device).
        on_cpu.grad[3] = float("nan")
        kept = [weight.detach().clone(), bias.detach().clone(), on_cpu.detach().clone()]
        optimizer.step()
        skipped = all(torch.equal(a, b) for a, b in zip((weight, bias, on_cpu), kept))
        ok, detail = ok and skipped, f"skipped {skipped}, counts {optimizer.nonfinite_counts()}"
    except Exception as failure:  # noqa: BLE001 (the check reports any failure)
        ok, detail = False, f"({failure})"
    record("MuonWithAdamW: a CPU AdamW group added to a fused AdamW steps, and its NaN skips all", ok, detail)


def resumed_from(param, optimizer, optimizer_class):
    """A copy of `param` and an optimizer_class over it, of lr 0.5 until it loads `optimizer`'s
    state dict. A copy of that, as from a file: a state dict holds the live buffers, which the
    load would otherwise share."""
    copied = torch.nn.Parameter(param.detach().clone())
    resumed = optimizer_class([copied], lr=0.5)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return copied, resumed


def one_more_step(first, second, grad):
    """Each (parameter, optimizer) takes a step on `grad` from the same weights: the second's
    momentum and update, relative to the first's."""
    before = first[0].detach().clone()
    for param, optimizer in (first, second):
        param.grad = grad.clone()
        optimizer.step()
    momentum = reference.relative_error(second[1].state[second[0]]["momentum_buffer"].cpu(),
                                        first[1].state[first[0]]["momentum_buffer"].cpu())
    update = reference.relative_error((second[0].detach() - before).cpu(), (first[0].detach() - before).cpu())
    return momentum, update


def main():
    # The sharded checks need two ranks; under torchrun with one process, the one-GPU checks.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Two ranks may share one GPU (scripts/rank_host_id.sh gives NCCL a host id per rank).
        local = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        if dist.get_world_size() == 4:
            mesh_checks(dist.get_rank(), 4, torch.device("cuda", local))
        else:
            sharded_checks(dist.get_rank(), dist.get_world_size(), torch.device("cuda", local))
            dtensor_checks(dist.get_rank(), dist.get_world_size(), torch.device("cuda", local))
    else:
        single_gpu_checks(torch.device("cuda", 0))
        torch_muon_checks(torch.device("cuda", 0))
        muon_with_adamw_checks(torch.device("cuda", 0))
        loss_scaler_checks(torch.device("cuda", 0))
        torch.cuda.set_device(0)
        if "MASTER_ADDR" in os.environ:  # torchrun's store (its agent owns it; a TCP one would wait)
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        dtensor_checks(0, 1, torch.device("cuda", 0))
    ok = all(results)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"torch GPU checks: {sum(results)} passed, {len(results) - sum(results)} failed", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
