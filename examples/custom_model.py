"""Train your own nn.Module and DataLoader with paratrain's minimal-change API.

    paratrain launch --nproc 2 examples/custom_model.py --epochs 3   # 2 workers, all-reduce
    python examples/custom_model.py --epochs 3                       # 1 process, single device

A small MLP learns a noisy linear map. ``pt.shard`` gives each rank its part of every global
batch (a DistributedSampler seeded the same on every rank); the optimizer's ``step()`` runs on
the averaged gradient; ``pt.clip_grad_norm_`` clips the global norm of that gradient. Rank 0
prints the loss averaged over all ranks.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 64, d_out: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, d_in) -> (N, d_out)
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()

    env = pt.init()  # the strategy: paratrain launch --strategy, else allreduce with N > 1, else single
    g = torch.Generator().manual_seed(0)  # the same data on every rank
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 4, generator=g) + 0.01 * torch.randn(4096, 4, generator=g)
    loader = pt.shard(DataLoader(TensorDataset(x, y), batch_size=args.global_batch, shuffle=True, drop_last=True))

    torch.manual_seed(0)
    model = MLP()
    model, optimizer = pt.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr))

    for epoch in range(args.epochs):
        total, steps = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb.to(env.device)), yb.to(env.device))
            loss.backward()
            pt.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
        pt.print(f"[rank {env.rank}] epoch {epoch + 1}: mean loss {pt.all_mean(total / steps):.4f} "
                 f"(world_size {env.world_size})")
    pt.shutdown()


if __name__ == "__main__":
    main()
