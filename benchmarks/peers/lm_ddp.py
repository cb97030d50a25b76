"""Word-level LSTM language model: a typical single-process PyTorch script and its ports.

Modelled on PyTorch's ``examples/word_language_model/main.py``: a word-level LSTM on
Penn Treebank, the corpus cut into ``batch_size`` parallel streams (``batchify``),
truncated BPTT with the hidden state carried from batch to batch, gradient clipping,
SGD with the learning rate divided by 4 when validation stops improving, the best
model saved and tested at the end.

* ``examples/lm_single.py``: the plain script (one process, one device);
* ``examples/lm_paratrain.py``: its port to paratrain, any strategy
  (``diff -u examples/lm_single.py examples/lm_paratrain.py`` shows every changed line);
* ``benchmarks/peers/lm_ddp.py``: its port to plain DistributedDataParallel (the yardstick).

    python examples/lm_single.py --epochs 1
    python examples/lm_paratrain.py --epochs 1                                  # one device
    paratrain launch --nproc 2 examples/lm_paratrain.py --epochs 1              # all-reduce (DDP)
    paratrain launch --nproc 2 --strategy ps-sync --num-ps 1 examples/lm_paratrain.py --epochs 1
    paratrain launch --strategy replicate --devices cpu:0,cpu:1 examples/lm_paratrain.py --epochs 1
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(description="word-level LSTM language model")
parser.add_argument("--data", default=os.path.join(os.environ.get("PARATRAIN_DATA", "data"), "ptb"))
parser.add_argument("--emsize", type=int, default=200)
parser.add_argument("--nhid", type=int, default=200)
parser.add_argument("--nlayers", type=int, default=2)
parser.add_argument("--lr", type=float, default=20.0)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=20)
parser.add_argument("--bptt", type=int, default=35)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--log-interval", type=int, default=200)
parser.add_argument("--max-batches", type=int, default=0, help="stop each epoch after this many batches (0: all)")
parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
parser.add_argument("--save", default="model.pt")
args = parser.parse_args()

torch.manual_seed(args.seed)
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > local_rank
device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
dist.init_process_group("nccl" if use_cuda else "gloo")
dtype = getattr(torch, args.dtype)


class Corpus:
    """Token ids of train/valid/test; the vocabulary grows on the training split, <eos> ends every line."""

    def __init__(self, path):
        self.word2idx = {}
        self.train, self.valid, self.test = (self.tokenize(os.path.join(path, f"ptb.{s}.txt"))
                                             for s in ("train", "valid", "test"))

    def tokenize(self, path):
        ids = []
        with open(path, encoding="utf8") as f:
            for line in f:
                for word in line.split() + ["<eos>"]:
                    ids.append(self.word2idx.setdefault(word, len(self.word2idx)))
        return torch.tensor(ids, dtype=torch.int64)


class RNNModel(nn.Module):
    """Embedding -> dropout -> LSTM -> dropout -> linear decoder; (T, B) ids -> (T, B, V) logits."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))  # (T, B, E)
        output, hidden = self.rnn(emb, hidden)  # (T, B, H)
        return self.decoder(self.drop(output)), hidden  # (T, B, V)

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def batchify(data, bsz):
    """(N,) -> (N // bsz, bsz): stream b is column b."""
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous().to(device)


def repackage_hidden(h):
    return tuple(v.detach() for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


corpus = Corpus(args.data)
eval_batch_size = 10
assert args.batch_size % world_size == 0, "the global batch must split over the ranks"
per_rank = args.batch_size // world_size
train_data = batchify(corpus.train, args.batch_size)[:, rank * per_rank:(rank + 1) * per_rank].contiguous()
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)

ntokens = len(corpus.word2idx)
model = RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device, dtype)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
model = DDP(model, device_ids=[local_rank] if use_cuda else None)


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.module.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model.module(data, hidden)
            total_loss += len(data) * criterion(output.view(-1, ntokens), targets).item()
    return total_loss / (len(data_source) - 1)


def train(epoch):
    model.train()
    total_loss, words, start_time = 0.0, 0, time.time()
    hidden = model.module.init_hidden(per_rank)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        if args.max_batches and batch >= args.max_batches:
            break
        data, targets = get_batch(train_data, i)
        hidden = repackage_hidden(hidden)
        optimizer.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output.view(-1, ntokens), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        total_loss += loss.item()
        words += targets.numel() * world_size
        if batch % args.log_interval == 0 and batch > 0 and rank == 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(f"| epoch {epoch:3d} | {batch:5d} batches | lr {optimizer.param_groups[0]['lr']:.2f} | "
                  f"{words / elapsed:8.0f} words/s | loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}")
            total_loss, words, start_time = 0.0, 0, time.time()


best_val_loss = None
for epoch in range(1, args.epochs + 1):
    epoch_start_time = time.time()
    train(epoch)
    val_loss = evaluate(val_data)
    if rank == 0:
        print(f"| end of epoch {epoch:3d} | time {time.time() - epoch_start_time:5.2f}s | valid loss {val_loss:5.2f} | "
              f"valid ppl {math.exp(val_loss):8.2f}")
    if not best_val_loss or val_loss < best_val_loss:
        if rank == 0:
            torch.save(model.module.state_dict(), args.save + ".tmp")
            os.replace(args.save + ".tmp", args.save)
        dist.barrier()
        best_val_loss = val_loss
    else:
        for group in optimizer.param_groups:
            group["lr"] /= 4.0

model.module.load_state_dict(torch.load(args.save, map_location=device))
test_loss = evaluate(test_data)
if rank == 0:
    print(f"| end of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}")
dist.destroy_process_group()
