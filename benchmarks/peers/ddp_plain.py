"""Peer 1: a plain, hand-written PyTorch DDP training loop for the Zaremba small PTB LSTM.

No paratrain code. This is what a competent user would write by hand, and the
yardstick paratrain's ``allreduce`` strategy is measured against (speed and
quality), see ``benchmarks/peers/compare_peers.py``. The other peers
(``accelerate_lm.py``, ``fabric_lm.py``) import the data reading, model,
evaluation and training loop from here and change only what their library
changes: process setup, model/optimizer wrapping, backward and clipping.

Recipe (Zaremba, Sutskever & Vinyals 2014, small, no dropout): embedding 200,
2-layer LSTM 200, linear decoder, every parameter U(-0.1, 0.1) (decoder bias 0,
as in PyTorch's word_language_model example), global batch 20 BPTT streams of
20 steps, hidden state carried (detached) and reset at every epoch start, SGD.
The paper's lr 1 / clip 5 are for the loss *summed* over the 20 steps; here the
loss is the mean cross-entropy over tokens, so lr = 1 * 20 = 20 and
clip_grad_norm_ = 5 / 20 = 0.25. lr *= 0.5 every epoch after epoch 4.

Data parallelism: the 20 streams are split over world_size ranks as contiguous
column blocks (rank r owns streams [r*20/W, (r+1)*20/W)); DDP averages the
gradients, so each step equals the single-process step on all 20 streams.
Threads: cores // local processes intra-op threads per process, as paratrain.
Device: CUDA + NCCL when every local rank has a GPU (``--device auto``), else
CPU + gloo.

Start:  python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/peers/ddp_plain.py \
            --data-dir /work/shared/data --epochs 1 [--max-steps N] [--warmup-steps W] [--json OUT]

Measurement: words_per_s = target tokens of the global batch (20 x 20 per step)
per second of training time, counting steps with index >= W only (the first W
steps are warm-up) and excluding evaluation. words_per_s_all_steps counts every
step. Validation perplexity (eval batch 10 streams, every prediction of the
split once, cross-entropy sums all-reduced) at the end of every epoch and at
the end of a run stopped by --max-steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

BPTT, BATCH, EVAL_BATCH = 20, 20, 10
LR, CLIP = 1.0 * BPTT, 5.0 / BPTT  # the paper's lr 1 / clip 5 for the mean-over-tokens loss
DECAY, DECAY_START = 0.5, 4


# ---- data: a ~30-line corpus reader --------------------------------------------------
def read_corpus(folder: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """Token ids (N,) per split, <eos> after every line. Vocabulary from the training
    split in order of first appearance, <eos> = 0."""
    vocab = {"<eos>": 0}
    splits = {}
    for split in ("train", "valid", "test"):
        ids = []
        with open(folder / f"ptb.{split}.txt", encoding="utf-8") as f:
            for line in f:
                for w in line.split() + ["<eos>"]:
                    if split == "train":
                        vocab.setdefault(w, len(vocab))
                    ids.append(vocab[w])  # valid/test words must be in the vocabulary
        splits[split] = torch.tensor(ids, dtype=torch.int64)
    return len(vocab), splits


def batchify(ids: torch.Tensor, streams: int) -> torch.Tensor:
    """(N,) -> (N // streams, streams): stream b is column b; the ragged end is dropped."""
    n = ids.numel() // streams
    return ids[: n * streams].view(streams, n).t().contiguous()


def eval_streams(ids: torch.Tensor, streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (L, streams) covering all N-1 predictions exactly once.

    The N-1 (input, target) pairs are cut into ``streams`` contiguous streams of
    L = ceil((N-1)/streams); the tail of the last stream is padding with target -100
    (ignored by cross_entropy), placed after the real tokens so it changes nothing.
    """
    n = ids.numel() - 1
    L = -(-n // streams)
    pad = L * streams - n
    x = torch.cat([ids[:-1], ids.new_zeros(pad)]).view(streams, L).t().contiguous()
    y = torch.cat([ids[1:], ids.new_full((pad,), -100)]).view(streams, L).t().contiguous()
    return x, y


@dataclass
class Data:
    rank: int
    world: int
    vocab: int
    train: torch.Tensor  # (L, BATCH / world): this rank's contiguous block of streams
    valid_x: torch.Tensor
    valid_y: torch.Tensor
    steps_per_epoch: int


def load_data(data_dir: str, device: torch.device) -> Data:
    """This rank's training streams and the whole validation split (call after joining the group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    assert BATCH % world == 0, f"global batch {BATCH} is not divisible by world_size {world}"
    vocab, ids = read_corpus(Path(data_dir) / "ptb")
    per_rank = BATCH // world
    train = batchify(ids["train"], BATCH)[:, rank * per_rank:(rank + 1) * per_rank].contiguous()
    valid_x, valid_y = eval_streams(ids["valid"], EVAL_BATCH)
    steps_per_epoch = (train.size(0) - 1) // BPTT  # full windows only (Zaremba)
    return Data(rank, world, vocab, train.to(device), valid_x.to(device), valid_y.to(device), steps_per_epoch)


# ---- model ------------------------------------------------------------------------------
class LSTMLM(nn.Module):
    def __init__(self, vocab: int, emb: int = 200, hidden: int = 200, layers: int = 2, init: float = 0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, layers)
        self.decoder = nn.Linear(hidden, vocab)
        for p in self.parameters():
            nn.init.uniform_(p, -init, init)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, x, hidden=None):  # x (T, B) -> logits (T, B, V), ((L, B, H), (L, B, H))
        out, hidden = self.rnn(self.embedding(x), hidden)
        return self.decoder(out), hidden


# ---- evaluation ---------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> float:
    """Perplexity over all of (x, y); rank r takes streams [r*B//W, (r+1)*B//W). Collective."""
    B = x.size(1)
    lo, hi = B * rank // world, B * (rank + 1) // world
    x, y = x[:, lo:hi], y[:, lo:hi]
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=x.device)  # (summed cross-entropy in nats, targets)
    hidden = None
    for i in range(0, x.size(0) if hi > lo else 0, BPTT):  # a rank may hold no stream
        logits, hidden = model(x[i:i + BPTT], hidden)
        tgt = y[i:i + BPTT].reshape(-1)
        acc[0] += F.cross_entropy(logits.view(-1, logits.size(-1)), tgt, reduction="sum", ignore_index=-100).double()
        acc[1] += (tgt != -100).sum()
    model.train()
    dist.all_reduce(acc)
    return math.exp(acc[0].item() / acc[1].item())


# ---- process setup ---------------------------------------------------------------------------
def parse_args(doc: str) -> argparse.Namespace:
    """The flags every peer takes."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--data-dir", default=os.environ.get("PARATRAIN_DATA"), help="folder holding ptb/")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = run all epochs)")
    p.add_argument("--warmup-steps", type=int, default=0, help="steps left out of words_per_s")
    p.add_argument("--log-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when every local rank has a GPU, else CPU")
    p.add_argument("--json", type=Path, help="write the results here (rank 0)")
    args = p.parse_args()
    if not args.data_dir:
        p.error("give --data-dir (the folder holding ptb/) or set PARATRAIN_DATA")
    return args


def local_ranks() -> tuple[int, int]:
    """(local rank, local world size) from torchrun's variables."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def pick_device(want: str) -> torch.device:
    local_rank, local_world = local_ranks()
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "cpu"
    return torch.device("cuda", local_rank) if want == "cuda" else torch.device("cpu")


def set_threads() -> int:
    """cores // local processes intra-op threads (paratrain's default); returns what was set before."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks()[1]))
    return before


def setup(args: argparse.Namespace, device: torch.device) -> tuple[Data, LSTMLM, torch.optim.SGD, dict]:
    """After joining the process group: threads, this rank's data, the model (seeded, on
    ``device``, not wrapped) and its SGD optimizer, and facts for the report."""
    threads_before = set_threads()
    data = load_data(args.data_dir, device)
    torch.manual_seed(args.seed)
    model = LSTMLM(data.vocab).to(device)
    return data, model, torch.optim.SGD(model.parameters(), lr=LR), {"device": str(device),
                                                                     "threads_before_set": threads_before}


# ---- training ------------------------------------------------------------------------------
def train(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, data: Data,
          backward: Callable[[torch.Tensor], None], clip: Callable[[], object], eval_model: nn.Module) -> dict:
    """The training loop. ``backward(loss)`` and ``clip()`` are the one places a library
    differs; here they are ``loss.backward()`` and ``clip_grad_norm_``."""
    rank = data.rank
    step, train_time, train_time_all, valid_ppl = 0, 0.0, 0.0, math.nan
    total_steps = args.epochs * data.steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    t_start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        if step >= total_steps:
            break
        for g in opt.param_groups:
            g["lr"] = LR * DECAY ** max(epoch - DECAY_START, 0)
        hidden, loss_sum, n_loss = None, 0.0, 0
        last = time.perf_counter()
        for i in range(data.steps_per_epoch):
            x = data.train[i * BPTT:(i + 1) * BPTT]
            y = data.train[i * BPTT + 1:(i + 1) * BPTT + 1]
            logits, hidden = model(x, hidden)
            hidden = tuple(h.detach() for h in hidden)
            loss = F.cross_entropy(logits.view(-1, data.vocab), y.reshape(-1))  # mean over this rank's tokens
            opt.zero_grad()
            backward(loss)  # DDP averages the gradients over the ranks
            clip()
            opt.step()
            loss_sum, n_loss = loss_sum + loss.item(), n_loss + 1
            step += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"[rank 0] epoch {epoch} step {step} loss {loss_sum / n_loss:.3f} (rank 0's shard) "
                      f"lr {opt.param_groups[0]['lr']:g}", flush=True)
                loss_sum, n_loss = 0.0, 0
            now = time.perf_counter()
            train_time_all += now - last
            if step > args.warmup_steps:
                train_time += now - last
            last = now
            if step >= total_steps:
                break
        valid_ppl = evaluate(eval_model, data.valid_x, data.valid_y, rank, data.world)  # end of epoch or of the run
        if rank == 0:
            print(f"[rank 0] step {step} epoch {epoch}: valid perplexity {valid_ppl:.2f}", flush=True)

    timed_steps = max(step - args.warmup_steps, 0)
    return {
        "words_per_s": timed_steps * BATCH * BPTT / train_time if train_time > 0 else math.nan,
        "words_per_s_all_steps": step * BATCH * BPTT / train_time_all,
        "warmup_steps": args.warmup_steps, "valid_ppl": valid_ppl, "steps": step,
        "epochs": round(step / data.steps_per_epoch, 3), "world_size": data.world, "global_batch": BATCH,
        "threads_per_process": torch.get_num_threads(), "train_time_s": train_time_all,
        "wall_time_s": time.perf_counter() - t_start,
    }


# SHUTDOWN: every peer passes a barrier before it leaves the process group. Without it, gloo's
# worker thread may still be freeing the last all-reduce (evaluate's, of a Python tensor: it
# needs the GIL) when the main thread, holding the GIL, frees the group and joins that thread:
# a deadlock, seen with Fabric on torch 2.13. The barrier waits without the GIL, and runs after.


def report(args: argparse.Namespace, result: dict) -> None:
    """Rank 0 prints the result as one JSON line and writes it to --json."""
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    args = parse_args(__doc__)
    device = pick_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    data, model, opt, facts = setup(args, device)

    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    result = train(args, model, opt, data, backward=lambda loss: loss.backward(),
                   clip=lambda: nn.utils.clip_grad_norm_(model.parameters(), CLIP), eval_model=model.module)
    report(args, {"program": "ddp_plain", **facts, **result})
    dist.barrier()  # see SHUTDOWN
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
