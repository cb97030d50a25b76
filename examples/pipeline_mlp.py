"""Your own loop, one call per optimizer step: ``pt.train_step(batch, loss_fn)``. It is the way
to train under ``pipeline`` (each process holds one stage of the model and the schedule runs the
micro-batches' forwards and backwards), and the same script runs under every other strategy.

An MLP (an ``nn.Sequential``: the pipeline cuts it into stages of consecutive layers) on the
handwritten digits that ship inside scikit-learn (``pip install "paratrain[digits]"``). The lines
marked ``# paratrain`` are the whole port of a plain single-process script.

    python examples/pipeline_mlp.py                                                  # one device
    paratrain launch --nproc 2 --strategy pipeline examples/pipeline_mlp.py          # 2 stages
    paratrain launch --nproc 4 --strategy pipeline --set dist.pipeline_stages=2 \\
        --set dist.microbatches=4 examples/pipeline_mlp.py                           # 2 replicas x 2 stages
    paratrain launch --nproc 2 examples/pipeline_mlp.py                              # all-reduce (DDP)
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import paratrain as pt  # paratrain

parser = argparse.ArgumentParser(description="MLP on scikit-learn's 8x8 digits, one call per step")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=64, help="global batch (images per optimizer step)")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--clip", type=float, default=1.0)
parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--save", default="mlp.pt")
args = parser.parse_args()

env = pt.init()  # paratrain
torch.manual_seed(args.seed)
dtype = getattr(torch, args.dtype)

digits = load_digits()
x = torch.tensor(digits.data, dtype=dtype) / 8.0 - 1.0  # (1797, 64) in [-1, 1]
y = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
test, train = order[:300], order[300:]

model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(),
                      nn.Linear(64, 10)).to(dtype)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
model, optimizer = pt.setup(model, optimizer)  # paratrain


def loss_fn(model, batch):
    """The mean cross-entropy over the batch's images."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def accuracy(images, labels):
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(dim=1) == labels).sum().item()
    model.train()
    return correct / len(labels)


steps = len(train) // args.batch_size
for epoch in range(1, args.epochs + 1):
    perm = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed + epoch))]
    picks = [perm[i * args.batch_size:(i + 1) * args.batch_size] for i in range(steps)]
    batches = [(x[p], y[p]) for p in picks]  # the global batches
    total = 0.0
    for batch in pt.shard(batches):  # paratrain: this rank's rows of every global batch
        total += pt.train_step(batch, loss_fn, clip=args.clip)  # paratrain: forward, backward, merge, clip, step
    pt.gather_model()  # paratrain: the pipeline's stages to every process, for evaluation
    pt.print(f"epoch {epoch:2d} | train loss {pt.all_mean(total / steps):.4f} | "  # paratrain
             f"test accuracy {accuracy(x[test], y[test]):.4f} | world_size {env.world_size}")

pt.save(model, args.save)  # paratrain
