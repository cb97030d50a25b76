"""Activation memory with and without model.activation_checkpointing (issue 12, part 4).

Method: the bytes of every tensor autograd saves for the backward during one training forward
(``torch.autograd.graph.saved_tensors_hooks``; storages counted once, parameters left out): all of
them are alive at the end of the forward, which is the activation peak of a step. Device-independent, so it reads the same
on CPU and GPU; RSS peaks on CPU are dominated by the process (libraries, data) and do not
resolve it. Also times forward+backward (median of 5).

    python benchmarks/activation_memory.py            # gpt_wt2's model: 2 layers, width 128, 4 heads,
                                                      # context 64, 16 windows per rank (global 32, W=2)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from paratrain.models import checkpointing
from paratrain.models.gpt import GPT


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, float]:
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights are not activations

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = model(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        times.append(time.perf_counter() - t0)
    return sum(seen.values()), statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=33278)  # WikiText-2
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    rows = []
    for on in (False, True):
        torch.manual_seed(0)
        model = GPT(a.vocab, a.context, n_layer=a.layers, n_head=a.heads, d_model=a.width, dropout=0.1)
        if on:
            checkpointing.enable(model)
        x = torch.randint(0, a.vocab, (a.batch, a.context))
        rows.append((on, *saved_bytes(model, x)))
    base_b, base_ms = rows[0][1], rows[0][2]
    print(f"GPT: {a.layers} layers, width {a.width}, {a.heads} heads, context {a.context}, batch {a.batch}, "
          f"vocab {a.vocab}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| activation checkpointing | saved for backward (MiB) | vs off | forward+backward ms | vs off |")
    print("|---|---|---|---|---|")
    for on, b, ms in rows:
        print(f"| {'on' if on else 'off'} | {b / 2**20:.1f} | {b / base_b:.3f} | {ms:.1f} | {ms / base_ms:.3f} |")


if __name__ == "__main__":
    main()
