"""Gradient compression for the DDP-based strategies (``allreduce``, ``zero1``): ``dist.comm_hook``.

Each choice is one of DDP's built-in communication hooks
(``torch.distributed.algorithms.ddp_comm_hooks``), which see one gradient bucket at a time:

* ``none``: DDP's all-reduce of the float32 bucket, averaged (``default_hooks.allreduce_hook``);
* ``fp16`` / ``bf16``: the bucket cast to 16 bits, all-reduced, averaged, cast back
  (``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``): half the bytes, rounding error;
* ``powersgd``: PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression
  for Distributed Optimization"; ``powerSGD_hook.powerSGD_hook``): each gradient matrix M (n x m)
  is sent as two rank-``r`` factors P (n x r) and Q (m x r), with error feedback (what compression
  dropped is added to the next step's gradient, per rank) and warm start (Q reused). Vectors
  (biases) and matrices that would not shrink go uncompressed. The first ``start_powerSGD_iter``
  steps are plain all-reduce.

On gloo, PowerSGD waits for each bucket's three chained all-reduces (uncompressed tensors, P, Q)
before DDP hands it the next bucket: their callbacks issue collectives from gloo's threads, and with
several buckets two ranks could issue them in different orders and wait for each other forever (seen
with torch 2.13 at 2 KB buckets). The cost is the overlap of PowerSGD's communication with backward.

Bytes: :class:`CommHook` counts the payload each rank hands to all-reduce, from what the hook
sends: the bucket's elements x 2 bytes (fp16/bf16) or x its element size (none, and PowerSGD's
plain steps), and for PowerSGD the hook's own count of elements after compression
(``PowerSGDState.total_numel_after_compression``, P and Q and the uncompressed tensors). A ring
all-reduce moves about 2 (W-1)/W of that payload over each rank's link
(:mod:`paratrain.bench.costmodel`).

State: PowerSGD's per-rank state (step counter, error-feedback memory, Q warm-start memory, its
random generator) is in checkpoints (:meth:`CommHook.state_dict`), so resume is bitwise. torch keeps
that memory flat per gradient bucket, and DDP lays buckets out anew after the first backward of a
process (in the order gradients became ready), which on resume happens after compression has begun.
:class:`CommHook` therefore records each bucket's layout (parameter indices and shapes) with the
memory and, when a bucket's layout changes, moves the memory over parameter by parameter (exact:
error feedback is elementwise, Q is per matrix).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from ..errors import UsageError

HOOKS = ("none", "fp16", "bf16", "powersgd")
HOOK_KEYS = ("comm_hook", "matrix_approximation_rank", "start_powerSGD_iter")  # their dist.* config keys


def check_options(comm_hook: str, rank: int, start_iter: int) -> None:
    """Raise UsageError (one line) for a hook this module does not know or PowerSGD settings torch refuses."""
    if comm_hook not in HOOKS:
        raise UsageError(f"dist.comm_hook = {comm_hook!r}: choose one of {', '.join(HOOKS)}")
    if rank < 1:
        raise UsageError(f"dist.matrix_approximation_rank = {rank}: PowerSGD needs a rank of at least 1")
    if comm_hook == "powersgd" and start_iter <= 1:
        raise UsageError(f"dist.start_powerSGD_iter = {start_iter}: PowerSGD with error feedback and warm "
                         f"start needs at least 2 plain all-reduce steps first; set it to 2 or more")


class CommHook:
    """The DDP communication hook of a strategy: the chosen built-in hook, plus the payload count and
    the mark of the last ready bucket (``on_bucket``, for step timing). Register it with
    :meth:`register`; every rank of the job must choose the same hook."""

    def __init__(self, name: str = "none", *, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1000,
                 on_bucket=None) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.name, self.on_bucket = name, on_bucket
        self.step_bytes = 0  # payload of the step in progress
        self.last_step_bytes = 0  # payload of the last finished step (all its buckets)
        self.total_bytes = 0
        self.layout: dict[int, tuple] = {}  # bucket -> ((parameter index, shape, offset), ...) of its memory
        self._index: dict[int, int] = {}  # id(parameter) -> its index in the model (set by register)
        self._moved: dict | None = None  # the memory by parameter, while buckets change their layout
        self._seen: set[int] = set()  # buckets of the backward in progress
        self._device = torch.device("cpu")
        self._serialize = False
        self.state: Any = None
        if name == "powersgd":
            self.state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=matrix_approximation_rank,
                start_powerSGD_iter=start_powerSGD_iter, use_error_feedback=True, warm_start=True, random_seed=0)
            self._hook = powerSGD_hook.powerSGD_hook
        else:
            self._hook = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                          "bf16": default_hooks.bf16_compress_hook}[name]

    def register(self, ddp, module: torch.nn.Module) -> None:
        """Register on ``ddp`` (a DistributedDataParallel wrapping ``module``)."""
        self._index = {id(p): i for i, p in enumerate(module.parameters())}
        self._device = next(module.parameters()).device
        import torch.distributed as dist

        self._serialize = dist.get_backend() == "gloo"
        ddp.register_comm_hook(self.state, self.communicate)

    # no annotations: DDP checks a hook's signature
    def communicate(self, state, bucket):
        """DDP's hook protocol: ``dist.GradBucket`` (a flat float bucket of gradients) -> future of
        the averaged bucket. Counts the payload; the last bucket of a backward ends the step's count."""
        if self.on_bucket is not None:
            self.on_bucket()
        buf = bucket.buffer()
        idx = bucket.index()
        if self.name == "powersgd":
            base = buf.data_ptr()
            now = tuple((self._index.get(id(p), -1), tuple(p.shape), (g.data_ptr() - base) // buf.element_size())
                        for p, g in zip(bucket.parameters(), bucket.gradients()))
            if self.layout.get(idx) != now and self.layout:  # a new layout (not a fresh process' first)
                self._relayout(idx, now)
            self.layout[idx] = now
            self._seen.add(idx)
            if bucket.is_last():
                self._forget_other_buckets()
            plain = self.state.iter < self.state.start_powerSGD_iter
            before = self.state.total_numel_after_compression
            fut = self._hook(self.state, bucket)
            if self._serialize:  # gloo: the bucket's chain of all-reduces ends before the next bucket's starts
                fut.wait()
            numel = buf.numel() if plain else self.state.total_numel_after_compression - before
            nbytes = numel * buf.element_size()
        else:
            fut = self._hook(state, bucket)
            nbytes = buf.numel() * (2 if self.name in ("fp16", "bf16") else buf.element_size())
        self.step_bytes += int(nbytes)
        if bucket.is_last():
            self.last_step_bytes, self.step_bytes = self.step_bytes, 0
            self.total_bytes += self.last_step_bytes
        return fut

    def metrics(self) -> dict[str, float]:
        """``comm_bytes_per_step``: this rank's all-reduce payload in the last step (bytes);
        ``comm_mb_total``: since the start of this process (MiB)."""
        return {"comm_bytes_per_step": self.last_step_bytes, "comm_mb_total": round(self.total_bytes / 2**20, 3)}

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's hook state (empty but for PowerSGD): tensors and numbers only (``weights_only``)."""
        st = self.state
        if st is None:
            return {}
        rng = st.rng.get_state()
        return {"hook": "powersgd", "iter": st.iter,
                "layout": {k: [[i, list(shape), off] for i, shape, off in v] for k, v in self.layout.items()},
                "error": dict(st.error_dict), "p": dict(st.p_memory_dict), "q": dict(st.q_memory_dict),
                "rng": [rng[0], torch.from_numpy(rng[1].astype("int64")), int(rng[2]), int(rng[3]), float(rng[4])],
                "numel_before": st.total_numel_before_compression, "numel_after": st.total_numel_after_compression}

    def load_state_dict(self, state: dict) -> None:
        """Load this rank's :meth:`state_dict`. A state of another hook is ignored (with a warning)."""
        st = self.state
        if st is None or not state:
            return
        if state.get("hook") != "powersgd":
            warnings.warn(f"the checkpoint has no PowerSGD state ({state.get('hook')}); PowerSGD starts afresh")
            return
        import numpy as np

        r = state["rng"]
        st.rng.set_state((r[0], r[1].numpy().astype(np.uint32), r[2], r[3], r[4]))
        st.iter = state["iter"]
        st.total_numel_before_compression = state["numel_before"]
        st.total_numel_after_compression = state["numel_after"]
        dev = self._device
        for key, d in (("error", st.error_dict), ("p", st.p_memory_dict), ("q", st.q_memory_dict)):
            d.clear()
            d.update({b: t.to(dev) for b, t in state[key].items()})
        self.layout = {b: tuple((i, tuple(shape), off) for i, shape, off in lay) for b, lay in state["layout"].items()}

    def _slices(self, layout: tuple):
        """Where each parameter of a bucket laid out as ``layout`` sits in the bucket's flat memory, the
        way ``powerSGD_hook`` (batch_tensors_with_same_shape=False) lays it out: yields
        ``(parameter index, (error start, end), (q start, end) or None, p length)``. The error memory
        is the bucket's flat gradient buffer (each gradient at its offset there); in Q, compressed
        matrices are grouped by shape in order of first appearance, m x r elements each (n x m matrix)."""
        st, groups = self.state, {}
        for i, shape, off in layout:
            numel = 1
            for d in shape:
                numel *= d
            n = shape[0] if shape else 1
            m = numel // max(n, 1)
            r = min(n, m, st.matrix_approximation_rank)
            compressed = len(shape) > 1 and (n + m) * r * st.min_compression_rate < n * m
            groups.setdefault((n, m) if compressed else None, []).append((i, (off, off + numel), m * r, n * r))
        q = 0
        for key, members in groups.items():
            for i, err, qlen, plen in members:
                if key is None:
                    yield i, err, None, 0
                else:
                    yield i, err, (q, q + qlen), plen
                    q += qlen

    def _forget_other_buckets(self) -> None:
        """At the end of a backward: drop the layout and memory of bucket indices it did not use."""
        st = self.state
        for b in [b for b in self.layout if b not in self._seen]:
            del self.layout[b]
            for d in (st.error_dict, st.p_memory_dict, st.q_memory_dict):
                d.pop(b, None)
        self._seen.clear()
        self._moved = None

    def _relayout(self, idx: int, now: tuple) -> None:
        """Bucket ``idx`` now holds the parameters ``now``: rebuild its error and Q memory from the memory
        of every bucket as it was laid out (parameter by parameter), and size its P memory."""
        st = self.state
        if self._moved is None:  # the first changed bucket of this backward: cut all memory into parameters
            self._moved = {}
            for b, lay in self.layout.items():
                for i, err, q, _ in self._slices(lay):
                    e = st.error_dict[b][err[0]:err[1]] if b in st.error_dict else None
                    qq = st.q_memory_dict[b][q[0]:q[1]] if q is not None and b in st.q_memory_dict else None
                    self._moved[i] = (e, qq)
        errs, qs, plen, dtype = [], [], 0, None
        for i, span, q, pl in self._slices(now):
            e, qq = self._moved.get(i, (None, None))
            dtype = e.dtype if e is not None else dtype
            errs.append((span, e))
            if q is not None:
                qs.append(qq.clone() if qq is not None else None)
                plen += pl
        if dtype is None:  # no error memory for these parameters yet: torch starts it at zero
            st.error_dict.pop(idx, None)
        else:
            flat = torch.zeros(max(b for (_, b), _ in errs), device=self._device, dtype=dtype)
            for (a, b), e in errs:
                if e is not None:
                    flat[a:b] = e
            st.error_dict[idx] = flat
        if qs and all(q is not None for q in qs):
            st.q_memory_dict[idx] = torch.cat(qs)
            st.p_memory_dict[idx] = torch.empty(plen, device=self._device, dtype=qs[0].dtype)
        else:  # a matrix without warm-start memory: this bucket draws a fresh Q (as at PowerSGD's start)
            st.q_memory_dict.pop(idx, None), st.p_memory_dict.pop(idx, None)
