"""An image classifier with a DataLoader, ported to paratrain: a BatchNorm CNN on the
handwritten digits that ship inside scikit-learn (``pip install "paratrain[digits]"``).

The lines marked ``# paratrain`` are the whole port of a plain single-process script:
the process setup, the sharded loader (each rank gets B/W images of every global batch
of B, shuffled with a seed shared by the ranks), the wrapped model and optimizer (with
BatchNorm statistics over every replica), accumulation without communication on all
but the last micro-batch, clipping of the merged gradient, rank-0 printing and saving.

    python examples/image_classifier.py --epochs 10                      # one device
    paratrain launch --nproc 2 examples/image_classifier.py --epochs 10  # all-reduce (DDP), 2 processes
    paratrain launch --nproc 2 --strategy ps-sync --num-ps 1 examples/image_classifier.py
    paratrain launch --strategy replicate --devices cpu:0,cpu:1 examples/image_classifier.py
    paratrain launch --nproc 2 --strategy ps-async --num-ps 1 examples/image_classifier.py --no-sync-bn

ps-async workers do not step together, so their BatchNorm statistics cannot be shared
(``--no-sync-bn``: each worker normalises with its own).
"""
import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt  # paratrain

parser = argparse.ArgumentParser(description="BatchNorm CNN on scikit-learn's 8x8 digits")
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--batch-size", type=int, default=64, help="global batch (images per optimizer step)")
parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--clip", type=float, default=5.0)
parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
parser.add_argument("--sync-bn", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--save", default="digits.pt")
args = parser.parse_args()

env = pt.init()  # paratrain
torch.manual_seed(args.seed)
dtype = getattr(torch, args.dtype)

digits = load_digits()
x = torch.tensor(digits.images, dtype=dtype).unsqueeze(1) / 8.0 - 1.0  # (1797, 1, 8, 8) in [-1, 1]
y = torch.tensor(digits.target, dtype=torch.int64)
order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
test, train = order[:300], order[300:]
train_loader = DataLoader(TensorDataset(x[train], y[train]), batch_size=args.batch_size, shuffle=True, drop_last=True)
train_loader = pt.shard(train_loader, seed=args.seed)  # paratrain


def conv_bn(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


model = nn.Sequential(conv_bn(1, 16), conv_bn(16, 32), nn.MaxPool2d(2), conv_bn(32, 64),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(dtype)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
model, optimizer = pt.setup(model, optimizer, sync_batchnorm=args.sync_bn)  # paratrain


def accuracy(images, labels):
    model.eval()
    with torch.no_grad():
        correct = (model(images).argmax(dim=1) == labels).sum().item()
    model.train()
    return correct / len(labels)


for epoch in range(1, args.epochs + 1):
    total, steps = 0.0, 0
    for xb, yb in train_loader:
        for k, (xm, ym) in enumerate(zip(xb.chunk(args.accumulation), yb.chunk(args.accumulation))):
            last = k == args.accumulation - 1
            with contextlib.nullcontext() if last else pt.no_sync():  # paratrain: no communication until the last
                loss = F.cross_entropy(model(xm), ym) / args.accumulation
                loss.backward()
            total += loss.item()
        pt.clip_grad_norm_(model.parameters(), args.clip)  # paratrain: clips the merged gradient
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    pt.print(f"epoch {epoch:2d} | train loss {pt.all_mean(total / steps):.4f} | "  # paratrain
             f"test accuracy {accuracy(x[test], y[test]):.4f} | world_size {env.world_size}")

pt.save(model, args.save)  # paratrain
