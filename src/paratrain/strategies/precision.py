"""Mixed precision for every strategy (Micikevicius et al. 2018, "Mixed Precision Training";
``torch.amp``): a mixin of :class:`~paratrain.strategies.base.Strategy`.

Parameters, gradients and optimizer state stay in the model's dtype (float32 master weights);
the wrapped model's forward runs under ``torch.autocast`` in bf16/fp16 (matmuls, convolutions,
LSTM cells in the low dtype; softmax, log-softmax, losses, norms and reductions in float32 by
autocast's own op lists) and returns its floating outputs as float32. fp16 scales the loss with
``torch.amp.GradScaler`` (:meth:`MixedPrecision.backward`); the merged gradient is unscaled before
clipping and before the non-finite check, and a step the scaler finds inf/NaN in is the
non-finite guard's skipped step (one mechanism). A strategy whose ranks hold different plain
gradients after the merge (the pipeline's stages) scales with
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``, whose ``unscale_`` all-reduces the
inf/NaN flag over every rank: all ranks skip the same steps and keep the same loss scale (fsdp's
DTensor gradients reduce the flag over the mesh themselves).
"""
from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, ContextManager

import torch

from ..errors import UsageError
from .step import StepRecord

PRECISIONS = ("fp32", "bf16", "fp16")
LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """What a strategy does for ``precision`` (``fp32``, ``bf16``, ``fp16``). Needs ``self.device``,
    ``self.optimizer``, ``self.model``, ``self.record`` and ``self.name`` from the strategy."""

    supports_fp16: bool = True  # float16 autocast with a GradScaler (the merge happens before optimizer.step())
    rank_local_gradients: bool = False  # ranks hold different plain gradients after the merge: share the inf check
    precision: str = "fp32"
    scaler: torch.amp.GradScaler | None = None  # fp16: made by start_precision() for the device

    @classmethod
    def check_precision(cls, precision: str) -> None:
        """Raise UsageError for an unknown precision, and for fp16 on a strategy without a shared
        loss scale (:attr:`supports_fp16`)."""
        if precision not in PRECISIONS:
            raise UsageError(f"train.precision = {precision!r}: use fp32, bf16 or fp16")
        if precision == "fp16" and not cls.supports_fp16:
            raise UsageError(f"train.precision = \"fp16\" needs a loss scaler that every replica agrees on, which "
                             f"strategy {cls.name!r} does not have; use train.precision = \"bf16\"")

    def set_precision(self, precision: str) -> None:
        """``fp32``, ``bf16`` or ``fp16``, before ``setup`` (see :meth:`check_precision`)."""
        self.check_precision(precision)
        self.precision = precision

    def start_precision(self) -> None:
        """In ``setup``, once the device is known: fp16's GradScaler (``ShardedGradScaler`` where
        :attr:`rank_local_gradients`: its ``unscale_`` is then a collective over every rank)."""
        if self.precision != "fp16":
            self.scaler = None
        elif self.rank_local_gradients:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type)
        else:
            self.scaler = torch.amp.GradScaler(self.device.type)
        if self.scaler is not None:  # the scale tensor exists before the first scaled loss: a pipeline stage
            self.scaler.scale(torch.zeros((), device=self.device))  # without a loss, or the zero-gradient step
            # with which torch's get_state_dict creates optimizer state, unscale too

    def autocast(self) -> ContextManager:
        """``torch.autocast`` on this strategy's device type in bf16/fp16 (nothing for fp32). The wrapped
        model's forward runs under it; a user's own loss computation may too."""
        low = LOW_DTYPES.get(self.precision)
        return nullcontext() if low is None else torch.autocast(self.device.type, dtype=low)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with fp16's loss scale applied first (``GradScaler.scale``). Every rank."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _unscale(self, record: StepRecord | None = None) -> None:
        """fp16: divide the merged gradient by the loss scale, once per step (before clipping)."""
        record = record or self.record
        if self.scaler is not None and not record.unscaled:
            self.scaler.unscale_(self.optimizer)
            record.unscaled = True

    def _update_scale(self) -> None:
        """After the step (made or skipped): GradScaler lowers the scale after an inf/NaN step and
        raises it after ``growth_interval`` good ones."""
        if self.scaler is not None:
            self.scaler.update()

    def precision_state_dict(self) -> dict:
        """What a checkpoint keeps of mixed precision: the GradScaler's state (scale, growth tracker)."""
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_precision_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def _forward(self, loss_fn: Callable, micro_batch: Any) -> torch.Tensor:
        """``loss_fn(model, micro_batch)``. On a CPU under bf16/fp16, a RuntimeError of a model whose
        recurrent layers have no kernel in that dtype here (:func:`rnn_runs_in`: oneDNN's LSTM has
        no float16 kernel on most CPUs and no bfloat16 one on a CPU without bfloat16 instructions,
        AVX-512 BF16 or AMX; torch issue #88136) becomes one line (UsageError) that names a precision
        that runs here; any other error is raised as it was."""
        try:
            return loss_fn(self.model, micro_batch)
        except RuntimeError as e:
            if self.device.type != "cpu" or self.precision == "fp32":
                raise
            if rnn_runs_in(self.model, LOW_DTYPES[self.precision]):
                raise
            raise no_rnn_kernel(self.model, self.precision, str(e).splitlines()[0][:100]) from None


def no_rnn_kernel(model: torch.nn.Module, precision: str, detail: str) -> UsageError:
    """The one-line error for ``model`` under ``precision`` (bf16, fp16) on a CPU where one of its
    recurrent layers has no kernel in that dtype (:func:`rnn_runs_in` is False), naming a precision
    that runs here; ``detail``: what showed it (the error's first line)."""
    better = "bf16" if precision == "fp16" and rnn_runs_in(model, torch.bfloat16) else "fp32"
    low = str(LOW_DTYPES[precision]).removeprefix("torch.")
    return UsageError(f"train.precision = \"{precision}\": a recurrent layer of this model has no {low} "
                      f"kernel on this CPU ({detail}); use train.precision = \"{better}\" on this CPU, or "
                      f"{precision} on a GPU")


_RNN_LAYERS = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN_TANH": torch.nn.RNN,
               "RNN_RELU": partial(torch.nn.RNN, nonlinearity="relu")}  # nn.RNNBase.mode -> a layer of that kind


def rnn_runs_in(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the CPU runs every kind of recurrent layer in ``model`` (its ``nn.RNNBase`` modules'
    ``mode``: LSTM, GRU, RNN with tanh or ReLU) under ``torch.autocast("cpu", dtype)`` for training: a
    2-unit layer of each kind, one forward and backward. Training, not inference: on a Xeon with
    AVX512-FP16 and AMX (2026-11-27) oneDNN ran an fp16 LSTM's forward under ``no_grad`` but had no
    fp16 primitive for its training forward. True for a model without one. The random generator's
    state is kept (``fork_rng``)."""
    modes = {m.mode for m in model.modules() if isinstance(m, torch.nn.RNNBase)}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        for mode in sorted(modes):
            layer = _RNN_LAYERS.get(mode, torch.nn.LSTM)(2, 2)
            try:
                with torch.autocast("cpu", dtype=dtype):
                    out, _ = layer(torch.zeros(1, 1, 2))
                out.float().sum().backward()
            except RuntimeError:
                return False
    return True
