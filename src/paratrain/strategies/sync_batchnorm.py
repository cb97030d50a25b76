"""Synchronised BatchNorm: batch statistics over every replica of the step, on CPU and GPU,
for processes and for towers.

With data parallelism each replica normalises with the statistics of its own part of
the batch, so N replicas with global batch B do not compute what one device with
batch B computes. ``torch.nn.SyncBatchNorm`` fixes that for DDP on CUDA only (it
refuses CPU tensors and DataParallel); this module does it for every strategy.

Training forward of :class:`SyncBatchNorm` for input x (N, C, *) on one replica
(two passes, each a sum over the replicas: Ioffe & Szegedy 2015's
normalisation with the statistics of the global batch, as in ``torch.nn.SyncBatchNorm``)::

    [count, sum]  = reduce([N * prod(*), x.sum over (N, *)])          # (1 + C,)
    mean          = sum / count                                         # (C,)
    var           = reduce(((x - mean)^2).sum over (N, *)) / count      # (C,), biased
    y             = (x - mean) * (weight / sqrt(var + eps)) + bias

Running statistics (eval) are updated with the global mean and the unbiased global
variance (``var * count / (count - 1)``), identical on every replica.

Between processes (:class:`GroupReducer`) the layer is one autograd function,
:class:`GroupBatchNorm`, with the backward of ``torch.nn.SyncBatchNorm``
(``batch_norm_backward_reduce``, one all-reduce, ``batch_norm_backward_elemt``, here in
plain tensor operations, which also run on CPU)::

    [sum_dy, sum_dy_xmu] = all_reduce([dy.sum over (N, *), (dy * xmu).sum over (N, *)])   # (2C,)
    dx = (weight / sqrt(var + eps)) * (dy - sum_dy / count - xmu * sum_dy_xmu / (count (var + eps)))
    dweight = (dy * xmu).sum / sqrt(var + eps), dbias = dy.sum                            # this rank's

so each rank gets d(sum of the ranks' losses)/dx, and the strategy's gradient average makes
it the gradient of the global loss. Three all-reduces a layer and step (two forward, one
backward); for a float32 input the backward holds one input-sized temporary besides dx.
Until 2026-11-30 the backward was autograd's through ``torch.distributed.nn.functional.all_reduce``: four
all-reduces, and four input-sized temporaries at once where ``torch.nn.BatchNorm2d``'s
backward holds dx alone (digits_cnn at N = 2: 3.49 MiB tracked against 3.20 planned from
one device's plain BatchNorm).
Between towers (threads of one process, :class:`TowerReducer`) ``reduce`` is a plain sum
of every tower's tensor, graphs included, so one ``backward()`` runs through all towers
and no thread waits in backward: the formulas above, differentiated by autograd.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .towers import TowerGroup, current_tower


class GroupReducer:
    """The ranks of a c10d process group, over which :class:`SyncBatchNorm` sums its statistics
    (:class:`GroupBatchNorm`; every rank calls it in the same order)."""

    def __init__(self, group) -> None:
        self.group = group

    def updates_buffers(self) -> bool:
        return True


class TowerReducer:
    """Differentiable sum over the towers of one process (each tower's forward runs in its own thread,
    with :func:`~paratrain.strategies.towers.current_tower` set to its index; every tower calls it in
    the same order). The sum is on the calling tower's device."""

    def __init__(self, group: TowerGroup) -> None:
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.group.exchange(current_tower(), t)
        total = parts[0].to(t.device)
        for p in parts[1:]:
            total = total + p.to(t.device)
        return total

    def updates_buffers(self) -> bool:
        return current_tower() == 0  # DataParallel's rule: tower 0's buffers are the model's


def _layout(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """For x (N, C, *): the dimensions a channel's statistics sum over (N, *), and the shape that
    broadcasts a (C,) tensor against x."""
    return [0, *range(2, x.dim())], [1, -1] + [1] * (x.dim() - 2)


class GroupBatchNorm(torch.autograd.Function):
    """Training BatchNorm with the statistics of every rank of ``group`` (module docstring): forward
    ``(x (N, C, *), weight (C,) or None, bias (C,) or None, eps, group) -> (y like x, mean (C,), var (C,),
    count ())``: mean, the biased var and the count of every rank's rows (the running statistics'; not
    differentiable).
    The statistics, x - mean and the gradients are computed in float32 at least (float64 for float64
    input), y returned in x's dtype, as torch's BatchNorm kernels do for a bf16 or fp16 input (so a
    bf16 input saves x - mean in float32: twice its bytes). Every rank of ``group``
    calls it, and its backward, in the same order (blocking c10d all-reduces: two in the forward,
    one in the backward). Once differentiable."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):
        import torch.distributed as dist

        with torch.autocast(x.device.type, enabled=False):  # the dtypes below are explicit
            dims, shape = _layout(x)
            acc = torch.promote_types(x.dtype, torch.float32)
            rows = torch.full((1,), x.numel() // x.size(1), dtype=acc, device=x.device)
            stats = torch.cat([rows, x.sum(dims, dtype=acc)])
            dist.all_reduce(stats, group=group)
            count, mean = stats[0], stats[1:] / stats[0]
            xmu = x - mean.view(shape)  # in acc: a bf16 or fp16 input is subtracted in float32, as torch's kernels do
            var = xmu.pow(2).sum(dims)
            dist.all_reduce(var, group=group)
            var = var / count
            invstd = torch.rsqrt(var + eps)  # (C,)
            scale = invstd * weight if weight is not None else invstd
            y = xmu * scale.view(shape)
            if bias is not None:
                y.add_(bias.view(shape))
            y = y.to(x.dtype)  # as torch's batch_norm: the input's dtype
        ctx.save_for_backward(xmu, invstd, weight, count)
        ctx.group, ctx.dtypes = group, (x.dtype, None if bias is None else bias.dtype)
        ctx.dims, ctx.shape = dims, shape
        ctx.mark_non_differentiable(mean, var, count)
        return y, mean, var, count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, _mean, _var, _count):
        import torch.distributed as dist

        xmu, invstd, weight, count = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        dy = dy.to(xmu.dtype)  # float32 at least (an fp16 loss scale's gradients would overflow in fp16)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)  # the one input-sized temporary besides dx
        dweight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        dbias = sum_dy.to(ctx.dtypes[1]) if ctx.needs_input_grad[2] else None
        dx = None
        if ctx.needs_input_grad[0]:  # the same on every rank (one model): every rank all-reduces, or none
            both = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(both, group=ctx.group)
            mean_dy, mean_dy_xmu = both[:invstd.numel()] / count, both[invstd.numel():] / count
            scale = invstd * weight if weight is not None else invstd
            dx = xmu * (invstd * invstd * mean_dy_xmu).view(shape)
            dx.neg_().add_(dy).sub_(mean_dy.view(shape)).mul_(scale.view(shape))
            dx = dx.to(ctx.dtypes[0])
        return dx, dweight, dbias, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over N-d input (N, C, *) whose training statistics span every replica.

    Args as ``torch.nn.BatchNorm2d``, plus ``reducer`` (a :class:`GroupReducer`,
    :class:`TowerReducer` or None: statistics of this replica alone, as plain BatchNorm).
    Eval mode uses the running statistics. Input shape (N, C) or (N, C, *); output the same.
    Raises ValueError for input with fewer than 2 dimensions.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, reducer: Any = None, device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.reducer = reducer

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, *), got {x.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or self.reducer is None:
            return super().forward(x)
        if isinstance(self.reducer, GroupReducer):  # processes: one function, torch.nn.SyncBatchNorm's backward
            y, mean, var, count = GroupBatchNorm.apply(x, self.weight if self.affine else None,
                                                       self.bias if self.affine else None, self.eps, self.reducer.group)
            if self.training and self.track_running_stats and self.reducer.updates_buffers():
                self._update_running(mean, var, count)
            return y
        dims, shape = _layout(x)
        local = torch.cat([x.new_full((1,), x.numel() // x.size(1)), x.sum(dims)])
        stats = self.reducer(local)  # (1 + C,)
        count, mean = stats[0], stats[1:] / stats[0]
        xmu = x - mean.view(shape)
        var = self.reducer(xmu.pow(2).sum(dims)) / count
        scale = torch.rsqrt(var + self.eps)  # (C,)
        if self.affine:  # one full-size product: autograd keeps xmu and (C,) tensors, as much as plain BatchNorm
            scale = scale * self.weight
        y = xmu * scale.view(shape)
        if self.affine:
            y = y + self.bias.view(shape)
        if self.training and self.track_running_stats and self.reducer.updates_buffers():
            self._update_running(mean.detach(), var.detach(), count.detach())
        return y

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        unbiased = var * count / (count - 1).clamp_min(1)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def convert(module: nn.Module, reducer: Any) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` (recursively) by :class:`SyncBatchNorm` using
    ``reducer``, keeping the same parameter and buffer tensors (an optimizer built on ``module``
    stays valid). Returns the converted module (a new object only when ``module`` itself is a BatchNorm)."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, reducer)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert(child, reducer))
    return out


def set_reducer(module: nn.Module, reducer: Any) -> None:
    """Point every :class:`SyncBatchNorm` in ``module`` at ``reducer``."""
    for m in module.modules():
        if isinstance(m, SyncBatchNorm):
            m.reducer = reducer


def group_reducer(group) -> GroupReducer | None:
    """A reducer over ``group`` (None: no other replica, plain BatchNorm statistics)."""
    return None if group is None else GroupReducer(group)


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())

