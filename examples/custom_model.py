"""Train your own nn.Module and DataLoader with paratrain's public API (no LSTM, no internals).

    paratrain launch --nproc 2 examples/custom_model.py --epochs 3   # 2 workers, all-reduce
    python examples/custom_model.py --epochs 3                       # 1 process, single device

A small MLP learns a noisy linear map. Each rank reads its shard of every epoch
through torch's DistributedSampler; paratrain's strategy averages the gradients,
clips the global norm and updates. Rank 0 prints the loss averaged over all ranks.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

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

    env = pt.init()  # RANK/WORLD_SIZE from paratrain launch; joins the process group
    g = torch.Generator().manual_seed(0)  # same data and initial weights on every rank
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 4, generator=g) + 0.01 * torch.randn(4096, 4, generator=g)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.global_batch // env.world_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = MLP()
    strategy = pt.get_strategy("allreduce" if env.world_size > 1 else "single", env)
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=args.lr))

    def loss_fn(m: nn.Module, batch) -> torch.Tensor:
        xb, yb = (t.to(strategy.device) for t in batch)
        return nn.functional.mse_loss(m(xb), yb)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, dtype=torch.float64)
        for batch in loader:
            result = strategy.train_step([batch], loss_fn, clip=1.0)
            total += torch.tensor([result.loss.item(), 1.0], dtype=torch.float64)
        strategy.all_reduce(total)  # every rank calls it
        if env.is_main:
            print(f"[rank {env.rank}] epoch {epoch + 1}: mean loss {total[0] / total[1]:.4f} "
                  f"(world_size {env.world_size})", flush=True)
    strategy.teardown()
    pt.shutdown()


if __name__ == "__main__":
    main()
