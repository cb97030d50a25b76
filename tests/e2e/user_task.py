"""A user's own task, as a user would write it on the public Task API (tests of ``--task``).

A small MLP regresses a noisy non-linear function of 8 inputs; ``[task]`` options: ``hidden`` (width),
``samples``. Also deliberately broken factories: one that raises, one whose Task lacks methods.
"""
from __future__ import annotations

import math

import torch
from torch import nn

import paratrain as pt


class Regression(pt.TaskBase):
    unit = "samples"
    headline = "rmse"

    def __init__(self, section: dict, env: pt.TaskEnv) -> None:
        self.env, self.hidden = env, int(section.get("hidden", 16))
        g = torch.Generator().manual_seed(int(section.get("data_seed", 0)))
        n = int(section.get("samples", 600))
        x = torch.randn(n, 8, generator=g, dtype=env.dtype)
        y = torch.sin(x @ torch.randn(8, 1, generator=g, dtype=env.dtype)) + 0.05 * torch.randn(n, 1, generator=g, dtype=env.dtype)
        self.splits = {"train": (x[:400], y[:400]), "valid": (x[400:500], y[400:500]), "test": (x[500:], y[500:])}

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def steps_per_epoch(self) -> int:
        return 400 // self.env.global_batch

    def train_steps(self, epoch: int, start: int):
        x, y = self.splits["train"]
        B = self.env.global_batch
        perm = torch.randperm(400, generator=torch.Generator().manual_seed(self.env.seed + epoch))
        for i in range(start, self.steps_per_epoch()):
            idx = perm[i * B:(i + 1) * B]
            yield pt.TrainStep([(x[idx[lo:hi]], y[idx[lo:hi]]) for lo, hi in self.env.micro_ranges()], float(B))

    def loss(self, model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).sum(), len(y)

    def eval_batches(self, split, share):
        x, y = self.splits[split]
        lo, hi = pt.shard_range(len(y), share[1], share[0])
        return [(x[lo:hi], y[lo:hi])] if hi > lo else []

    def eval_sums(self, model, batch):
        x, y = batch
        return torch.stack([((model(x) - y) ** 2).sum().double(), torch.tensor(float(len(y)), dtype=torch.float64)])

    def metrics(self, sums):
        mse = float(sums[0] / sums[1])
        return {"loss": mse, "rmse": math.sqrt(mse)}


def make(section, env):
    return Regression(section, env)


def broken(section, env):
    raise ValueError("no data here")


class Incomplete:
    def build_model(self):
        return nn.Linear(1, 1)


def incomplete(section, env):
    return Incomplete()
