"""Newton-Schulz benchmark, nccl-tests style: shardmuon against what PyTorch users run today,
on the same inputs, in the same run, with every result checked against float64.

    torchrun --nproc_per_node=2 bench/bench_newton_schulz.py [--shapes 8192x28672,...]
        [--dtypes bf16,fp32] [--schedules quintic:5,polar_express:8] [--repeats 10] [--out DIR]

One process per GPU. Rows of the table:
  - 1 GPU: each rank orthogonalizes a whole matrix on its own GPU. Baseline: torch.optim.Muon's
    Newton-Schulz (its own function for bf16 quintic; the same code form, A = X X^T,
    B = b A + c A A, X = a X + B X, for other dtypes and schedules). That function takes one
    (a, b, c) for all steps, so it runs the quintic schedule's first step five times: the
    same flops, another iteration; its error is against a float64 run of that iteration.
  - 2 GPUs, sharded along dim 0 or 1 (uneven where the extent is odd). Baselines:
    all-gather then the torch Newton-Schulz on every rank ("all-gather"), and the
    per-iteration Gram all-reduce in PyTorch ("gram": A_r = X_r X_r^T, all_reduce(A), on
    long-side shards; short-side shards are first moved to long-side ones with one
    all_to_all and moved back after, as the library's (d) does).
Times: CUDA events around one call, after warm-ups, median over repeats, the slowest rank's
median; shardmuon and the baselines of a row timed in turn, call by call. Each call starts on an
idle GPU (--start idle, the default): its time then includes the host's latency before the GPU
has work (Python, the library's checks, kernel launches: 0.1-0.2 ms on the lent H200s, more than
a one-kernel op's), which a training step usually hides behind its backward pass, still running
on the GPU when the optimizer is called. --start queued times the GPU's work alone: a 1 ms GPU
spin (torch.cuda._sleep) is enqueued before the start event, so that the host has enqueued the
call's first kernels when the GPU reaches them; for every case alike, the GEMM rates included.
Useful TFLOP/s counts K (4 s^2 L + 2 s^3) for an s x L matrix (s <= L) whatever the algorithm.
The floor is shardmuon's executed GEMM flops per GPU (its symmetric products included; (e)'s own
where the algorithm column says "+ (e)", (c)'s where "+ (c)") over the GEMM rate measured at the
start of the run, plus the communication it cannot hide at the all-reduce / all-to-all rates
measured there.
Errors: relative Frobenius distance to a float64 Newton-Schulz of the gathered matrix.
Power: under sustained bf16 GEMMs an H200 reaches its 700 W cap and lowers its SM clock (from
1980 MHz to about 1500 in the eleventh session's runs), so a row can run at a lower clock than
the GEMM rate measured at the start. Each shardmuon row therefore also gives the SM clock
(read from NVML right after each timed call; the median, rank 0's) and the GEMM rate measured
again right after those calls, in the same power state, with its time over the floor at that
rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from shardmuon.torch import NewtonSchulz  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {"bf16": 3e-2, "fp32": 1e-4}  # DESIGN.md section 4
EPS = 1e-7


def parse_shape(text):
    rows, cols = text.lower().split("x")
    return int(rows), int(cols)


def even_split(extent, parts):
    return [extent // parts + (1 if r < extent % parts else 0) for r in range(parts)]


def offsets_of(sizes):
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return out


# -- the baselines (plain PyTorch) -------------------------------------------------------------

def torch_newton_schulz(matrix, coefficients, dtype):
    """torch.optim.Muon's Newton-Schulz form in `dtype` (it runs bf16 with one (a, b, c))."""
    x = matrix.to(dtype)
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.mT
    x = x / x.norm().clamp(min=EPS)
    for a, b, c in coefficients:
        gram = x @ x.mT
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.mT if transposed else x


def torch_optim_muon_function():
    """torch.optim.Muon's own Newton-Schulz function, where this PyTorch has it."""
    try:
        from torch.optim import _muon
        function = _muon._zeropower_via_newtonschulz
        function(torch.randn(8, 16, device="cuda"), (3.4445, -4.7750, 2.0315), 5, EPS)
        return function
    except Exception:  # absent, or another signature: its form below stands in
        return None


def gram_all_reduce_newton_schulz(wide_shard, coefficients, group=None):
    """The per-iteration Gram all-reduce on a long-side shard X_r (s x L_r, a view)."""
    x = wide_shard
    squares = x.float().square().sum()
    dist.all_reduce(squares, group=group)
    x = x / squares.sqrt().clamp(min=EPS).to(x.dtype)
    for a, b, c in coefficients:
        gram = x @ x.mT
        dist.all_reduce(gram, group=group)
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x


def exchange_blocks(x, cut_dim, cut_sizes, join_dim, join_sizes, rank):
    """One all_to_all: x cut along cut_dim into cut_sizes (piece q to rank q); from rank q comes
    a piece of join_sizes[q] along join_dim (and cut_sizes[rank] along cut_dim), and the pieces
    are joined along join_dim. Short-side shards to long-side blocks (cut the long side, join
    the short one), and back (cut the short side, join the long one)."""
    offsets = offsets_of(cut_sizes)
    sends = [x.narrow(cut_dim, offsets[q], cut_sizes[q]).contiguous() for q in range(len(cut_sizes))]
    receives = []
    for size in join_sizes:
        extent = [0, 0]
        extent[join_dim], extent[cut_dim] = size, cut_sizes[rank]
        receives.append(torch.empty(extent, dtype=x.dtype, device=x.device))
    dist.all_to_all(receives, sends)
    return torch.cat(receives, dim=join_dim)


# -- measuring ------------------------------------------------------------------------------

def sm_clock_mhz():
    """The SM clock now (NVML, through torch), or None where it cannot be read."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # no NVML binding: the clock column shows "-"
        return None


class Timer:
    SPIN_CYCLES = 2_000_000  # about 1 ms at the H200's 1980 MHz

    def __init__(self, warmups, repeats, world, queued=False):
        self.warmups, self.repeats, self.world = warmups, repeats, world
        self.queued = queued  # each timed call enqueued behind a GPU spin (see Times above)
        self.clock_mhz = None  # the median SM clock read after each of the first case's timed calls

    def medians_ms(self, cases, across_ranks=True):
        """The median time of each (prepare, run) case, the cases timed in turn, call by call.
        Under sustained GEMMs the GPU lowers its clock (see Power above): timed one case after
        the other, the case timed last ran at the lowest clock, which moved ratios between the
        same algorithms by up to 0.07 from run to run (bench_rank_compute, twenty-eighth
        session). With more than one rank, the slowest rank's median."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = [[] for _ in cases]
        clocks = []
        for i in range(self.warmups + self.repeats):
            for case, (prepare, run) in enumerate(cases):
                prepare()
                torch.cuda.synchronize()
                if self.world > 1:
                    dist.barrier()
                if self.queued:
                    torch.cuda._sleep(self.SPIN_CYCLES)
                start.record()
                run()
                end.record()
                end.synchronize()
                if i >= self.warmups:
                    times[case].append(start.elapsed_time(end))
                    if case == 0:
                        clocks.append(sm_clock_mhz())
        self.clock_mhz = None if None in clocks else statistics.median(clocks)
        medians = torch.tensor([statistics.median(t) for t in times], device="cuda")
        if self.world > 1 and across_ranks:
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        return [float(m) for m in medians]

    def median_ms(self, prepare, run, across_ranks=True):
        return self.medians_ms([(prepare, run)], across_ranks)[0]


class GemmRate:
    """The GEMM rate of one dtype: the product of two n x n matrices (8192 for bf16, 4096 for
    float32), timed as everything else is. Measured once at the start (the floor's rate) and
    again after each shardmuon row (the rate in that row's power state); with more than one
    rank, the slowest rank's."""

    def __init__(self, dtype_name):
        self.n = 8192 if dtype_name == "bf16" else 4096
        self.a = torch.randn(self.n, self.n, device="cuda").to(DTYPES[dtype_name])
        self.b = torch.randn(self.n, self.n, device="cuda").to(DTYPES[dtype_name])
        self.start_rate = None  # FLOP/s, set by measure_rates

    def measure(self, timer, across_ranks):
        ms = timer.median_ms(lambda: None, lambda: self.a @ self.b, across_ranks=across_ranks)
        return 2 * self.n**3 / (ms * 1e-3)


def measure_rates(timer, world, gemm_rates):
    """The ceilings of this run: GEMM rates, all-reduce bus bandwidth, all-to-all rate, and
    the SM clock (MHz) during each GEMM measurement."""
    rates, clocks = {}, {}
    for name, gemm in gemm_rates.items():
        gemm.start_rate = rates["gemm_" + name] = gemm.measure(timer, across_ranks=False)
        clocks["gemm_" + name] = timer.clock_mhz
    if world > 1:
        buffer = torch.randn(64 * 2**20, device="cuda")  # 256 MiB of float32
        ms = timer.median_ms(lambda: None, lambda: dist.all_reduce(buffer))
        rates["all_reduce_bus"] = buffer.numel() * 4 * 2 * (world - 1) / world / (ms * 1e-3)
        send = torch.randn(64 * 2**20, device="cuda")
        recv = torch.empty_like(send)
        ms = timer.median_ms(lambda: None, lambda: dist.all_to_all_single(recv, send))
        rates["all_to_all"] = send.numel() * 4 * (world - 1) / world / (ms * 1e-3)  # bytes leaving a rank
    return rates, clocks


def power_columns(timer, gemm, compute, comm, ms, across_ranks):
    """The last three columns of a shardmuon row, measured right after its timed calls: the
    SM clock (the median of those read after each call), the GEMM rate now, and the time over
    the floor at that rate (the floor's compute part rescaled from the start's rate)."""
    clock = timer.clock_mhz
    start_rate = gemm.start_rate
    rate_now = gemm.measure(timer, across_ranks)
    floor_now = compute * start_rate / rate_now + comm
    clock_text = "-" if clock is None else f"{clock:.0f}"
    return f"{clock_text} | {rate_now / 1e12:.0f} | {ms / floor_now:.2f}"


def triangle_elements(s, target=None, max_blocks=16, columns_per_launch=4):
    """Elements of the packed lower block columns, and of the last group of block columns
    that a summed Gram all-reduces last: mirrors SymmetricTiles::split, the CUDA backend's
    block target and kGramColumnsPerLaunch (src/core/symmetric_tiles.h,
    src/cuda/cuda_backend.cpp, src/core/ns_cost_model.h)."""
    if target is None:
        target = int(os.environ.get("SHARDMUON_SYMMETRIC_BLOCK", "512"))
    blocks = min(max(s // target, 1), max_blocks)
    for fewer in range(blocks, max(2, blocks // 2) - 1, -1):  # fewer blocks of one width
        if s % (32 * fewer) == 0:
            blocks = fewer
            break
    width = (s // blocks) // 32 * 32
    if width == 0:
        blocks = 1
    starts = [j * width for j in range(blocks)] + [s]
    columns = [(s - starts[j]) * (starts[j + 1] - starts[j]) for j in range(blocks)]
    last_group = (blocks - 1) // columns_per_launch * columns_per_launch
    return sum(columns), sum(columns[last_group:])


def product_triangle_elements(s):
    """Elements of the lower tiles of the products into full matrices on one rank (a Gram
    that is not summed, A A, (e)'s products): mirrors SymmetricTiles::for_products, 32 equal
    blocks where s is a multiple of 4096 (unless SHARDMUON_SYMMETRIC_BLOCK overrides the
    width), else the packed Gram's tiles."""
    if "SHARDMUON_SYMMETRIC_BLOCK" not in os.environ and s % 4096 == 0:
        return 32 * 33 // 2 * (s // 32) ** 2
    return triangle_elements(s)[0]


def product_side(s):
    """The short side the products run on: mirrors product_side in src/core/symmetric_tiles.h
    with the CUDA backend's multiple (its block width, or SHARDMUON_SHORT_SIDE_MULTIPLE): s
    rounded up to 8, and further to that multiple where this adds at most 1/32 of the side
    and leaves at least two blocks."""
    multiple = int(os.environ.get("SHARDMUON_SHORT_SIDE_MULTIPLE",
                                  os.environ.get("SHARDMUON_SYMMETRIC_BLOCK", "512")))
    multiple = -(-multiple // 8) * 8
    aligned = -(-s // 8) * 8
    if multiple <= 8 or aligned < 2 * multiple:
        return aligned
    rounded = -(-aligned // multiple) * multiple
    return rounded if (rounded - aligned) * 32 <= aligned else aligned


def floor_ms(s, length, iterations, rates, dtype_name, world, algorithm, iteration="standard"):
    """shardmuon's executed GEMM flops over the measured GEMM rate, plus the communication
    it cannot hide. A summed Gram's all-reduce can only overlap the Gram's own products (what
    follows needs the sum), so per reduction at least the last group of block columns, and
    at least the whole all-reduce less the Gram's products, is in the open; it moves bf16 for
    bf16 (gram_sum_dtype in src/core/newton_schulz.cpp), float32 for float32. For (d) also the
    first piece of the exchange in and the last piece out (the library moves the shards in
    four pieces, each beside products). iteration names what runs on that distribution:
    "standard", "(e)" or "(c)". (e)'s products: per step Q = a I + b R + c R R, then the Gram of
    X at a restart or M <- Q M, then X <- M X at the end of a restart's span or R <- Q (R Q); it
    restarts every 2 steps (gram_iteration_restart in src/core/newton_schulz.h) and sums the
    Gram once per restart. (c)'s: per step the Gram and two applications of it to the rank's
    block (Y = c S X, X <- S Y + d X), no A A."""
    s, length = product_side(s), -(-length // 8) * 8  # as the library pads them
    packed, last_group = triangle_elements(s)
    products = product_triangle_elements(s)
    summed = world > 1 and algorithm.startswith("gram")
    local_length = length / world if summed else length  # (a) iterates on the whole matrix
    gram = 2 * (packed if summed else products) * local_length
    square, apply = 2 * products * s, 2 * s * s * local_length
    if iteration == "(e)":
        restart = 2
        flops = sum(square + (gram if k % restart == 0 else square) +
                    (apply if k + 1 == iterations or (k + 1) % restart == 0 else 2 * square)
                    for k in range(iterations))
        reductions = -(-iterations // restart)
    elif iteration == "(c)":
        flops = iterations * (gram + 2 * apply)
        reductions = iterations
    else:
        flops = iterations * (gram + square + apply)
        reductions = iterations
    rate = rates["gemm_" + dtype_name]
    compute = flops / rate * 1e3
    comm = 0.0
    if summed:
        sum_bytes = 2 if dtype_name == "bf16" else 4
        ring = 2 * (world - 1) / world / rates["all_reduce_bus"] * 1e3
        exposed = max(last_group * sum_bytes * ring, packed * sum_bytes * ring - gram / rate * 1e3)
        comm += reductions * exposed
        if algorithm.endswith("redistributed"):
            element = 2 if dtype_name == "bf16" else 4
            pieces = 4  # kExchangePieces in src/core/ns_cost_model.h
            moved = (s * length / world) * element * (world - 1) / world
            comm += 2 * moved / pieces / rates["all_to_all"] * 1e3
    return compute, comm


def iteration_of(ns, shape, dim=None, sizes=None):
    """Which iteration `ns` runs for these arguments: "standard", "(e)" (Gram Newton-Schulz) or
    "(c)" (the summed Gram applied twice)."""
    if ns.uses_gram_iteration(shape, dim, sizes):
        return "(e)"
    return "(c)" if ns.uses_applied_twice(shape, dim, sizes) else "standard"


def label(algorithm, iteration):
    """The algorithm column: the distribution, and "+ (e)" or "+ (c)" where it runs one of them."""
    return algorithm if iteration == "standard" else f"{algorithm} + {iteration}"


def relative_error(result, reference):
    return float((result.double() - reference).norm() / reference.norm())


def gather_shards(shard, dim, sizes, world):
    """The whole matrix from uneven shards (padded to the largest for all_gather)."""
    largest = max(sizes)
    extent = list(shard.shape)
    extent[dim] = largest
    padded = torch.zeros(extent, dtype=shard.dtype, device=shard.device)
    padded.narrow(dim, 0, shard.shape[dim]).copy_(shard)
    blocks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(blocks, padded)
    return torch.cat([b.narrow(dim, 0, sizes[r]) for r, b in enumerate(blocks)], dim=dim)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x4096,4096x14336,14336x4096,8192x8192,8192x28672,"
                        "28672x8192,16384x16384,3001x10007")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--fp32-shapes", default="4096x4096,4096x14336,3001x10007",
                        help="fp32 runs only these (its GEMMs run at a tenth of bf16's rate)")
    parser.add_argument("--schedules", default="quintic:5,polar_express:8")
    parser.add_argument("--algorithm", default="auto",
                        help="shardmuon's algorithm; on one GPU duplicated and gram_allreduce "
                             "run the standard iteration, gram_newton_schulz (e), gram_applied_twice (c)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--start", choices=("idle", "queued"), default="idle",
                        help="each timed call starts on an idle GPU, or queued behind a GPU spin "
                             "(the GPU's work alone; see Times above)")
    parser.add_argument("--tag", default="", help="appended to the table's file name")
    parser.add_argument("--out", default=os.environ.get("OUT", "out/bench"))
    args = parser.parse_args()
    if args.start == "queued" and not hasattr(torch.cuda, "_sleep"):
        parser.error("--start queued needs torch.cuda._sleep, which this PyTorch lacks")

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # Ranks may share a GPU (scripts/rank_host_id.sh): a check of this script's multi-rank
    # rows on one GPU, whose times then mean nothing.
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    # The 1-GPU rows run over a group of one (no cross-rank argument check in the call).
    alone = dist.new_subgroups(group_size=1)[0] if world > 1 else None
    timer = Timer(args.warmups, args.repeats, world, queued=args.start == "queued")
    gemm_rates = {name: GemmRate(name) for name in args.dtypes.split(",")}
    rates, clocks = measure_rates(timer, world, gemm_rates)
    optim_muon = torch_optim_muon_function()

    lines = []

    def emit(text):
        if rank == 0:
            print(text, flush=True)
            lines.append(text)

    emit(f"# shardmuon Newton-Schulz benchmark: {torch.cuda.get_device_name()} x {world}, "
         f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
         f"torch.optim.Muon function {'found' if optim_muon else 'not found'}, "
         f"calls timed from {'a queue (GPU work alone)' if timer.queued else 'an idle GPU'}")
    emit("rates measured in this run: " + ", ".join(
        f"{k} {v / 1e12:.1f} TFLOP/s" + (f" (SM clock {clocks[k]:.0f} MHz)" if clocks.get(k) else "")
        if k.startswith("gemm") else f"{k} {v / 1e9:.0f} GB/s"
        for k, v in rates.items()))
    emit("")
    emit("| shape | dtype | schedule | GPUs | shards | algorithm | shardmuon (ms) | useful TFLOP/s | "
         "error | passes | torch 1-GPU (ms) | x | all-gather (ms) | x | gram (ms) | x | "
         "floor (ms) compute+comm | time/floor | SM MHz | GEMM now (TFLOP/s) | time/floor now |")
    emit("|" + "---|" * 21)

    failures = 0
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        shapes = args.shapes if dtype_name == "bf16" else args.fp32_shapes
        for shape_text in shapes.split(","):
            rows, cols = parse_shape(shape_text)
            s, length = min(rows, cols), max(rows, cols)
            for schedule_text in args.schedules.split(","):
                schedule, steps = schedule_text.split(":")
                steps = int(steps)
                ns_local = NewtonSchulz(alone, ns_steps=steps, coefficient_type=schedule,
                                        algorithm=args.algorithm)
                local_iteration = iteration_of(ns_local, (rows, cols))
                coefficients = ns_local.coefficients()
                useful = steps * (4 * s * s * length + 2 * s**3)
                generator = torch.Generator(device="cuda").manual_seed(1000 + rows + cols)
                matrix = torch.randn(rows, cols, device="cuda", generator=generator).to(dtype)
                reference = torch_newton_schulz(matrix.double(), coefficients, torch.float64)
                tolerance = TOLERANCE[dtype_name]

                # One GPU: every rank on its own, shardmuon and torch timed in turn.
                work = torch.empty_like(matrix)
                use_own = optim_muon is not None and dtype_name == "bf16" and schedule == "quintic"

                def torch_one():
                    if use_own:
                        return optim_muon(matrix, coefficients[0], steps, EPS)
                    return torch_newton_schulz(matrix, coefficients, dtype)

                ms, torch_ms = timer.medians_ms(
                    [(lambda: work.copy_(matrix), lambda: ns_local(work, (rows, cols))),
                     (lambda: None, torch_one)], across_ranks=False)
                compute, comm = floor_ms(s, length, steps, rates, dtype_name, 1, "local",
                                         local_iteration)
                power = power_columns(timer, gemm_rates[dtype_name], compute, comm, ms, across_ranks=False)
                error = relative_error(work, reference)
                # torch.optim.Muon's function takes one (a, b, c) for every step: it runs the
                # schedule's first step `steps` times (the same flops), so its error is measured
                # against a float64 run of that iteration.
                own_reference = (torch_newton_schulz(matrix.double(), [coefficients[0]] * steps, torch.float64)
                                 if use_own else reference)
                torch_error = relative_error(torch_one(), own_reference)
                passes = error <= tolerance
                failures += 0 if passes else 1
                emit(f"| {rows}x{cols} | {dtype_name} | {schedule} {steps} | 1 | - | "
                     f"{label('local', local_iteration)} | {ms:.2f} | "
                     f"{useful / ms / 1e9:.0f} | {error:.2e} | {'yes' if passes else 'NO'} | "
                     f"{torch_ms:.2f}{' (own fn)' if use_own else ''} err {torch_error:.1e} | "
                     f"{torch_ms / ms:.2f} | | | | | {compute:.2f}+0 | {ms / compute:.2f} | {power} |")
                if world == 1:
                    continue

                for dim in (0, 1):
                    extent = (rows, cols)[dim]
                    sizes = even_split(extent, world)
                    offset = offsets_of(sizes)[rank]
                    shard = matrix.narrow(dim, offset, sizes[rank]).contiguous()
                    ns = NewtonSchulz(dist.group.WORLD, ns_steps=steps, coefficient_type=schedule,
                                      algorithm=args.algorithm)
                    algorithm = ns.plan((rows, cols), dim, sizes)
                    iteration = iteration_of(ns, (rows, cols), dim, sizes)
                    work = torch.empty_like(shard)

                    def all_gather_baseline():
                        whole = gather_shards(shard, dim, sizes, world)
                        return torch_newton_schulz(whole, coefficients, dtype).narrow(dim, offset, sizes[rank])

                    long_dim = 1 if cols >= rows else 0
                    gram_out = torch.empty_like(shard)
                    if dim == long_dim:
                        def gram_baseline():
                            wide = shard if long_dim == 1 else shard.mT
                            result = gram_all_reduce_newton_schulz(wide, coefficients)
                            gram_out.copy_(result if long_dim == 1 else result.mT)
                    else:
                        long_sizes = even_split((rows, cols)[long_dim], world)

                        def gram_baseline():
                            block = exchange_blocks(shard, 1 - dim, long_sizes, dim, sizes, rank)
                            wide = block if long_dim == 1 else block.mT
                            result = gram_all_reduce_newton_schulz(wide, coefficients)
                            result = result if long_dim == 1 else result.mT
                            gram_out.copy_(exchange_blocks(result, dim, sizes, 1 - dim, long_sizes, rank))

                    # shardmuon and the two baselines timed in turn (work then holds shardmuon's
                    # result).
                    ms, gather_ms, gram_ms = timer.medians_ms(
                        [(lambda: work.copy_(shard), lambda: ns(work, (rows, cols), dim, sizes)),
                         (lambda: None, all_gather_baseline), (lambda: None, gram_baseline)])
                    compute, comm = floor_ms(s, length, steps, rates, dtype_name, world, algorithm,
                                             iteration)
                    power = power_columns(timer, gemm_rates[dtype_name], compute, comm, ms, across_ranks=True)
                    error = relative_error(gather_shards(work, dim, sizes, world), reference)
                    gathered = gather_shards(all_gather_baseline().contiguous(), dim, sizes, world)
                    gather_error = relative_error(gathered, reference)
                    gram_baseline()
                    gram_error = relative_error(gather_shards(gram_out, dim, sizes, world), reference)
                    passes = error <= tolerance
                    failures += 0 if passes else 1
                    uneven = "" if len(set(sizes)) == 1 else " uneven"
                    emit(f"| {rows}x{cols} | {dtype_name} | {schedule} {steps} | {world} | dim {dim}{uneven} | "
                         f"{label(algorithm, iteration)} | {ms:.2f} | {useful / ms / 1e9:.0f} | {error:.2e} | "
                         f"{'yes' if passes else 'NO'} | | | {gather_ms:.2f} err {gather_error:.1e} | "
                         f"{gather_ms / ms:.2f} | {gram_ms:.2f} err {gram_error:.1e} | {gram_ms / ms:.2f} | "
                         f"{compute:.2f}+{comm:.2f} | {ms / (compute + comm):.2f} | {power} |")
                matrix = reference = work = None  # freed before empty_cache
                torch.cuda.empty_cache()

    emit("")
    emit(f"accuracy: {failures} shardmuon result(s) outside the tolerance (bf16 3e-2, fp32 1e-4)")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_newton_schulz_{world}gpu{args.tag}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    if world > 1:
        dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
