"""Model FLOPs utilisation (MFU): achieved model FLOP/s over the device's peak FLOP/s.

Definition (as torchtitan and PaLM, Chowdhery et al. 2022, appendix B): MFU = (model FLOPs per
step) x (steps per second) / (devices x peak FLOP/s of one device). Model FLOPs are counted, not
estimated: :class:`torch.utils.flop_counter.FlopCounterMode` over one training step (the forward and
backward matrix products, convolutions and attention, and the fused CPU LSTM/GRU layers it lacks;
element-wise ops are not counted, as in ``6 N`` per token), on each process' second step (the first
may set up: a pipeline infers its shapes). With activation checkpointing the recomputed forward is
counted too (that is hardware FLOPs utilisation, HFU, for those blocks).

A private torch API, guarded where it is entered (a torch that renames it gives NaN): the
counter runs without ``FlopCounterMode``'s per-module tracker (``_FlopCounterMode`` alone), whose
backward hooks ``torch.distributed.pipelining``'s ``autograd.grad`` refuses.

The peak comes from :data:`PEAK_TFLOPS` (dense, from the vendors' datasheets) for a known GPU, or on
a CPU from a matrix-product micro-benchmark (:func:`measured_cpu_peak`: the best FLOP/s of square
products at this process' thread count, through each of torch's product kernels, cached per CPU
model, threads and dtype in ``$XDG_CACHE_HOME/paratrain/peak_flops.json``); :func:`peak_flops` says
which it used. Both kernels count: a CPU without float16 arithmetic runs ``torch.mm`` in float16
on a reference kernel at ~1 GFLOP/s, while ``F.linear`` (oneDNN, what a model's layers call) runs
~15x faster; a peak from ``torch.mm`` alone made a float16 model's MFU 3.5.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

# Dense peak TFLOP/s by device-name substring (most specific first) and dtype, from NVIDIA's datasheets
# (float32 without TF32; bfloat16/float16 on tensor cores without sparsity).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.2}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}),  # SXM5
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.1, "float16": 362.1, "float32": 91.6}),
    ("L4", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}),
    ("A10", {"bfloat16": 125.0, "float16": 125.0, "float32": 31.2}),
    ("V100", {"float16": 125.0, "float32": 15.7}),
    ("T4", {"float16": 65.0, "float32": 8.1}),
)


def _rnn_layer_flop(inp, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    """One LSTM/GRU layer on the CPU (``aten.mkldnn_rnn_layer``): per time step and sequence, the
    input and recurrent products, 2 (G H x I + G H x H) FLOPs for G gates (w_ih: G H x I)."""
    steps = inp[0] * inp[1]  # (T, B, I) or (B, T, I): the product is what counts
    return 2 * steps * (w_ih[0] * w_ih[1] + w_hh[0] * w_hh[1])


def _rnn_layer_backward_flop(inp, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    """Its backward: the gradients of the input (and hidden state) and of both weights, twice the forward."""
    return 2 * _rnn_layer_flop(inp, w_ih, w_hh)


def _cudnn_rnn_flop(inp, weight, weight_stride0, *args, out_shape=None, **kwargs) -> int:
    """A whole cuDNN RNN (``aten._cudnn_rnn``: every layer and direction of ``nn.LSTM`` / ``nn.GRU``
    on a GPU). ``weight`` holds ``weight_stride0`` shapes per layer and direction, in ``nn.LSTM``'s
    order: w_ih (G H x I), w_hh (G H x P or H), with biases b_ih, b_hh, and with ``proj_size`` last
    w_hr (P x H): an odd count. Per time step and sequence, 2 x (w_ih + w_hh + w_hr) FLOPs of each.
    ``inp``: (T, B, I), (B, T, I) or packed (sum of lengths, I)."""
    steps = inp[0] * inp[1] if len(inp) == 3 else inp[0]
    per_step = 0
    for i in range(0, len(weight), weight_stride0):
        per_step += math.prod(weight[i]) + math.prod(weight[i + 1])
        if weight_stride0 % 2:  # the projection, w_hr
            per_step += math.prod(weight[i + weight_stride0 - 1])
    return 2 * steps * per_step


def _cudnn_rnn_backward_flop(inp, weight, weight_stride0, *args, out_shape=None, **kwargs) -> int:
    """Its backward (``aten._cudnn_rnn_backward``): the gradients of the inputs and of the weights,
    twice the forward, as for the CPU's layers."""
    return 2 * _cudnn_rnn_flop(inp, weight, weight_stride0)


def _custom_flops() -> dict:
    """Formulas torch's counter lacks: fused RNNs (``nn.LSTM``, ``nn.GRU``): the CPU's oneDNN layers and
    the GPU's cuDNN ones."""
    aten = torch.ops.aten
    out = {}
    if hasattr(aten, "mkldnn_rnn_layer"):
        out[aten.mkldnn_rnn_layer] = _rnn_layer_flop
        out[aten.mkldnn_rnn_layer_backward] = _rnn_layer_backward_flop
    if hasattr(aten, "_cudnn_rnn"):
        out[aten._cudnn_rnn] = _cudnn_rnn_flop
        out[aten._cudnn_rnn_backward] = _cudnn_rnn_backward_flop
    return out


def _counter():
    """torch's :class:`~torch.utils.flop_counter.FlopCounterMode` without its per-module breakdown:
    the module tracker registers backward hooks that ``torch.distributed.pipelining``'s
    ``autograd.grad`` refuses ("A leaf node was passed to _will_engine_execute_node"); the total is
    all paratrain reads."""
    from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

    class Totals(FlopCounterMode):
        def __enter__(self):
            self.flop_counts.clear()
            self.mode = _FlopCounterMode(self)
            self.mode.__enter__()
            return self

        def __exit__(self, *args):
            done, self.mode = self.mode.__exit__(*args), None
            return done

    return Totals(display=False, custom_mapping=_custom_flops())


def count_flops(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), FLOPs it ran) counted by torch's flop counter (:func:`_counter`, plus the fused CPU RNN
    layers, :func:`_custom_flops`); NaN where the counter cannot follow the call (the result is kept
    either way)."""
    try:
        counter = _counter()
        counter.__enter__()
    except Exception:  # noqa: BLE001 - counting is optional
        return fn(), math.nan
    try:
        out = fn()
    finally:
        counter.__exit__(None, None, None)
    return out, float(counter.get_total_flops())


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "paratrain" / "peak_flops.json"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


PRODUCTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "torch.mm": torch.mm, "F.linear": torch.nn.functional.linear}  # the kernels a CPU peak is taken over


def measured_cpu_peak(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.3,
                      fresh: bool = False) -> float:
    """FLOP/s of the fastest ``size`` x ``size`` matrix product (2 size^3 FLOPs) at this process'
    intra-op threads: the best of repeats for about ``seconds`` per kernel of :data:`PRODUCTS`;
    cached (see the module). ``fresh``: measure even when cached. The cache keeps the best value
    ever measured for the key: a peak measured while other processes share the cores is low, and
    a later, better measurement replaces it; a worse one never does."""
    key = f"{_cpu_name()}|threads={torch.get_num_threads()}|{dtype}|{size}|{'+'.join(PRODUCTS)}"
    path = _cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    known = cached.get(key)
    known = float(known) if isinstance(known, (int, float)) else 0.0
    if known > 0 and not fresh:
        return known
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    best = known
    for product in PRODUCTS.values():
        product(a, b)
        end, mine = time.perf_counter() + seconds, 0.0
        while time.perf_counter() < end or mine == 0.0:
            t0 = time.perf_counter()
            product(a, b)
            mine = max(mine, 2 * size ** 3 / max(time.perf_counter() - t0, 1e-9))
        best = max(best, mine)
    if best > known:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**cached, key: best}))
            os.replace(tmp, path)
        except OSError:
            pass
    return best


def table_peak(name: str, dtype: str) -> float | None:
    """Peak FLOP/s of the GPU called ``name`` in ``dtype`` from :data:`PEAK_TFLOPS` (the first, most
    specific, entry whose key is in the name), or None."""
    for part, table in PEAK_TFLOPS:
        if part in name:
            return table[dtype] * 1e12 if dtype in table else None
    return None


def peak_flops(device: torch.device, dtype: str, achieved: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one ``device`` in ``dtype`` (a torch dtype name), where it comes from).

    ``achieved``: the FLOP/s per device a run reached. On a CPU, a cached peak below it was measured
    while the cores were shared: the peak is measured again (1 s per kernel) and, if it is still
    below, the peak is NaN (no MFU) and the source says why, rather than an MFU above 1."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name, dtype)
        if peak is not None:
            return peak, f"datasheet: {name}, {dtype} dense {peak / 1e12:g} TFLOP/s"
        return math.nan, f"{name} ({dtype}) is not in paratrain's peak table; no MFU"
    dt = getattr(torch, dtype)
    peak = measured_cpu_peak(dt)
    if achieved is not None and achieved > peak:
        peak = measured_cpu_peak(dt, seconds=1.0, fresh=True)
    what = (f"{dtype} 1024x1024 matrix product ({' or '.join(PRODUCTS)}, the faster) on {torch.get_num_threads()} "
            f"thread(s), {peak / 1e9:.1f} GFLOP/s")
    if achieved is not None and achieved > peak:
        return math.nan, (f"measured: {what}, below this run's {achieved / 1e9:.1f} GFLOP/s per device (the cores "
                          f"were shared when it was measured); no MFU: measure again on an idle machine")
    return peak, f"measured: {what}"


def mfu(flops_per_step: float, step_s: float, devices: int, peak: float) -> float:
    """flops_per_step / step_s / (devices x peak); NaN when any input is unknown or not positive."""
    if not all(math.isfinite(x) and x > 0 for x in (flops_per_step, step_s, devices, peak)):
        return math.nan
    return flops_per_step / step_s / (devices * peak)
