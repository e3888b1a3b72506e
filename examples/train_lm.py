"""The main job: train a small character-level transformer on Debian's fortune-cookie corpus
(package `fortunes`, read from /usr/share/games/fortunes; nothing is downloaded) twice from
the same initialization and data: with shardmuon's Muon for the hidden matrices and AdamW
for the rest, and with AdamW alone. Prints progress (step, loss, throughput, time left),
writes the loss curves to a CSV and a PNG.

    python3 examples/train_lm.py                       # CPU, one process, a few minutes
    python3 examples/train_lm.py --tp 2                # tensor parallel over 2 processes
    torchrun --nproc_per_node=2 examples/train_lm.py   # the same, launched by torchrun
    python3 examples/train_lm.py --amp fp16            # on a GPU: float16 autocast, GradScaler

Under torchrun the attention and MLP matrices are tensor-parallel (Megatron style: q, k, v
and the first MLP layer split by output rows, the attention output and the second MLP layer
split by input columns), marked with ``partition_dim`` for the optimizer. Every TP size
starts from the same full weights (each rank keeps its slice), so TP = 2 follows TP = 1.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import shardmuon.torch as st  # noqa: E402

FORTUNES = Path("/usr/share/games/fortunes")


# -- data ---------------------------------------------------------------------------------

def load_corpus(path: Path) -> str:
    """The fortune files (text, one cookie after another, separated by '%' lines)."""
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix not in (".dat", ".u8")
                   and not p.is_symlink())
    if not files:
        raise SystemExit(f"no corpus in {path}: install Debian's 'fortunes' package (apt-get install fortunes)")
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


class Batches:
    """Random windows of the encoded corpus, from a seeded generator: every rank of a TP group,
    and every run, sees the same batches."""

    def __init__(self, text: str, seq: int, batch: int, device, seed: int):
        chars = sorted(set(text))
        self.vocab = len(chars)
        index = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([index[c] for c in text], dtype=torch.long)
        split = int(0.95 * len(data))
        self.train, self.val = data[:split], data[split:]
        self.seq, self.batch, self.device = seq, batch, device
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, data: torch.Tensor, generator=None):
        starts = torch.randint(0, len(data) - self.seq - 1, (self.batch,), generator=generator or self.generator)
        x = torch.stack([data[s:s + self.seq] for s in starts])
        y = torch.stack([data[s + 1:s + self.seq + 1] for s in starts])
        return x.to(self.device), y.to(self.device)


# -- tensor parallelism -------------------------------------------------------------------

class _CopyToParallel(torch.autograd.Function):
    """Identity forward; the gradient is summed over the TP group (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        if dist.is_initialized() and dist.get_world_size() > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad)
        return grad


class _ReduceFromParallel(torch.autograd.Function):
    """Sum over the TP group forward (output of a row-parallel layer); identity backward."""

    @staticmethod
    def forward(ctx, x):
        if dist.is_initialized() and dist.get_world_size() > 1:
            x = x.contiguous()
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def tp_rank_size():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def full_init(name: str, shape, std: float, seed: int) -> torch.Tensor:
    """The same full weight on every rank and every TP size: seeded by the parameter's name."""
    name_hash = sum(ord(c) * 31 ** i for i, c in enumerate(name)) % 2**31
    generator = torch.Generator().manual_seed(seed * 1000003 + name_hash)
    return torch.randn(*shape, generator=generator) * std


class ParallelLinear(torch.nn.Module):
    """A bias-free linear layer split over the TP group: 'column' splits the output features
    (weight rows, partition_dim 0), 'row' splits the input features (weight columns,
    partition_dim 1) and sums the partial outputs."""

    def __init__(self, name, in_features, out_features, kind, seed, std):
        super().__init__()
        rank, size = tp_rank_size()
        full = full_init(name, (out_features, in_features), std, seed)
        dim = 0 if kind == "column" else 1
        if full.shape[dim] % size:
            raise SystemExit(f"{name}: {full.shape[dim]} features do not split over {size} ranks")
        piece = full.shape[dim] // size
        self.weight = torch.nn.Parameter(full.narrow(dim, rank * piece, piece).contiguous())
        self.weight.partition_dim = dim
        self.kind = kind

    def forward(self, x):
        if self.kind == "column":
            return F.linear(_CopyToParallel.apply(x), self.weight)
        return _ReduceFromParallel.apply(F.linear(x, self.weight))


class Block(torch.nn.Module):
    def __init__(self, index, dim, heads, seed):
        super().__init__()
        _, size = tp_rank_size()
        self.local_heads = heads // size
        self.head_dim = dim // heads
        std, out_std = 0.02, 0.02 / math.sqrt(2 * 4)
        self.norm1 = torch.nn.LayerNorm(dim)
        self.q = ParallelLinear(f"h{index}.q", dim, dim, "column", seed, std)
        self.k = ParallelLinear(f"h{index}.k", dim, dim, "column", seed, std)
        self.v = ParallelLinear(f"h{index}.v", dim, dim, "column", seed, std)
        self.out = ParallelLinear(f"h{index}.out", dim, dim, "row", seed, out_std)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.fc = ParallelLinear(f"h{index}.fc", dim, 4 * dim, "column", seed, std)
        self.proj = ParallelLinear(f"h{index}.proj", 4 * dim, dim, "row", seed, out_std)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (layer(h).view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
                   for layer in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(attention.transpose(1, 2).reshape(b, t, -1))
        return x + self.proj(F.gelu(self.fc(self.norm2(x))))


class CharTransformer(torch.nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq, seed):
        super().__init__()
        self.token = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Embedding(seq, dim)
        with torch.no_grad():
            self.token.weight.copy_(full_init("token", (vocab, dim), 0.02, seed))
            self.position.weight.copy_(full_init("position", (seq, dim), 0.02, seed))
        self.blocks = torch.nn.ModuleList(Block(i, dim, heads, seed) for i in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(full_init("lm_head", (vocab, dim), 0.02, seed))

    def forward(self, tokens):
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


# -- training -----------------------------------------------------------------------------

def make_optimizer(name, model, args):
    if name == "muon":
        groups = st.muon_param_groups(model, muon_lr=args.muon_lr, adamw_lr=args.adamw_lr,
                                      adamw_weight_decay=args.weight_decay)
        # spectral scale x 0.2: the update's RMS matches AdamW's, so one lr suits both.
        return st.MuonWithAdamW(groups, weight_decay=args.weight_decay, scale_mode="spectral",
                                extra_scale_factor=0.2, adamw_betas=(0.9, 0.95),
                                process_group=dist.group.WORLD if dist.is_initialized() else None)
    return torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95),
                             weight_decay=args.weight_decay)


@torch.no_grad()
def evaluate(model, batches, steps=8):
    generator = torch.Generator().manual_seed(1234)
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
              for x, y in (batches.sample(batches.val, generator) for _ in range(steps))]
    return sum(losses) / len(losses)


def train(name, args, text, device, log):
    rank, size = tp_rank_size()
    batches = Batches(text, args.seq, args.batch, device, args.seed)
    model = CharTransformer(batches.vocab, args.dim, args.layers, args.heads, args.seq, args.seed).to(device)
    optimizer = make_optimizer(name, model, args)
    warmup = max(1, args.steps // 20)

    def warmup_cosine(s):
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
    # Mixed precision: bf16 autocast needs nothing more; float16's narrow range needs loss
    # scaling, whose GradScaler hands the Muon step its scale and found_inf on the GPU.
    amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    scaler = make_grad_scaler() if args.amp == "fp16" else None
    rows, start = [], time.time()
    tokens_per_step = args.batch * args.seq
    for step in range(1, args.steps + 1):
        x, y = batches.sample(batches.train)
        with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped on every rank where a gradient overflowed
            scaler.update()
        schedule.step()
        if step % args.log_every == 0 or step == args.steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.time() - start
            val = evaluate(model, batches) if step % (args.log_every * 4) == 0 or step == args.steps else float("nan")
            rate = step * tokens_per_step / elapsed
            left = elapsed / step * (args.steps - step)
            rows.append({"optimizer": name, "tp": size, "step": step, "train_loss": loss.item(),
                         "val_loss": val, "tokens_per_s": rate, "elapsed_s": elapsed})
            log(f"[{name:5s} tp={size}] step {step:5d}/{args.steps}  loss {loss.item():.4f}"
                + (f"  val {val:.4f}" if not math.isnan(val) else "")
                + f"  {rate:8.0f} tok/s  {left:6.1f} s left")
    return rows


def make_grad_scaler():
    amp = getattr(torch, "amp", None)
    if amp is not None and hasattr(amp, "GradScaler"):
        return amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()  # PyTorch before 2.3


def plot(rows, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["optimizer"], r["tp"]) for r in rows}):
        series = [r for r in rows if (r["optimizer"], r["tp"]) == key]
        label = ("shardmuon Muon + AdamW" if key[0] == "muon" else "AdamW") + f" (TP={key[1]})"
        axis.plot([r["step"] for r in series], [r["train_loss"] for r in series], label=label + ", train")
        val = [r for r in series if not math.isnan(r["val_loss"])]
        axis.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", label=label + ", validation")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats per character)")
    axis.set_title("Character-level transformer on Debian's fortune cookies")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=FORTUNES)
    parser.add_argument("--out", type=Path, default=Path("out/train_lm"))
    parser.add_argument("--steps", type=int, default=None, help="default: 200 on CPU, 600 on GPU")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--muon-lr", type=float, default=3e-3)
    parser.add_argument("--adamw-lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--optimizers", default="muon,adamw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size: launches that many processes (GPUs if there are "
                             "enough, else CPU processes over gloo); under torchrun, its world size")
    parser.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                        help="autocast dtype of the forward pass; fp16 adds a GradScaler (CUDA only)")
    args = parser.parse_args()
    if args.amp == "fp16" and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--amp fp16 needs a GPU (its GradScaler is CUDA's here); bf16 runs on the CPU too")
    if args.amp == "fp16" and max(args.tp, int(os.environ.get("WORLD_SIZE", 1))) > 1:
        # Each rank's scaler would update its scale from its own found_inf: tensor-parallel
        # ranks need one they agree on (Megatron's scaler all-reduces it), else their scales,
        # and so the gradients they sum, part ways.
        parser.error("--amp fp16 runs with --tp 1 only: a GradScaler's scale is per rank")
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:
        import socket

        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_launched, args=(args.tp, port), nprocs=args.tp, join=True)
        return
    run(args)


def _launched(rank, world, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main()


def run(args):
    if "WORLD_SIZE" in os.environ:  # tensor parallel over the launched ranks
        world = int(os.environ["WORLD_SIZE"])
        # Ranks may share a GPU where each has its own NCCL host id (scripts/rank_host_id.sh,
        # for checks on a one-GPU machine); else one GPU a rank, or CPU processes.
        shared = "NCCL_HOSTID" in os.environ
        use_cuda = args.device != "cpu" and torch.cuda.is_available() and (
            torch.cuda.device_count() >= world or shared)
        local = int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())
        if use_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    else:
        use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(max(1, os.cpu_count() // max(1, int(os.environ.get("WORLD_SIZE", 1)))))
    if args.steps is None:
        args.steps = 600 if device.type == "cuda" else 200
    rank, size = tp_rank_size()

    def log(message):
        if rank == 0:
            print(message, flush=True)

    text = load_corpus(args.data)
    log(f"corpus: {args.data} ({len(text) / 1e6:.2f} M characters); device {device}, TP={size}; "
        f"{args.steps} steps of {args.batch} x {args.seq} characters")
    rows = []
    for name in args.optimizers.split(","):
        rows += train(name, args, text, device, log)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = f"tp{size}"
        with open(args.out / f"loss_{tag}.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, args.out / f"loss_{tag}.png")
        finals = {r["optimizer"]: r for r in rows if r["step"] == args.steps}
        summary = ", ".join(f"{k}: val {v['val_loss']:.4f}" for k, v in finals.items())
        log(f"final validation loss ({summary}); wrote {args.out / f'loss_{tag}.csv'} and "
            f"{args.out / f'loss_{tag}.png'}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
