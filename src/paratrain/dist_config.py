"""``[dist]``: how the work is split (:class:`DistConfig`), a section of :class:`paratrain.config.Config`.

A frozen keyword-only dataclass validated in ``__post_init__``: every bad value raises
:class:`~paratrain.errors.UsageError` naming the key, the value and what is allowed. It learns the
strategies, and the keys each strategy owns (``Strategy.dist_keys``), from :mod:`paratrain.strategies`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .checks import check_at_least, check_choice
from .errors import UsageError

CPU_ALLOCATORS = ("retain", "default")  # dist.cpu_allocator (devices.apply_cpu_allocator)


def _strategies():
    from . import strategies

    return strategies


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """How the work is split. ``strategy`` is a registry key of
    :mod:`paratrain.strategies`; ``nproc`` is the number of worker processes on
    this node."""

    strategy: str = field(default_factory=lambda: _strategies().DEFAULT)
    nproc: int = 1
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # intra-op threads per process; 0 = cores // local processes
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # host:port of the rendezvous; "" = 127.0.0.1 and a free port
    rdzv_id: str = ""  # job id of a multi-node rendezvous; "" = $SLURM_JOB_ID, else derived (paratrain.launch)
    rdzv_timeout_s: int = 120  # seconds every node waits for the others to arrive
    max_restarts: int = 0
    bucket_mb: float = 25.0  # allreduce, zero1: DDP gradient bucket size in MiB
    broadcast_buffers: bool = True  # allreduce, zero1: DDP sends rank 0's buffers (BatchNorm statistics) every
    # forward; false: each rank keeps its own (model.sync_batchnorm keeps them equal and needs no broadcast)
    comm_hook: str = "none"  # allreduce, zero1: none | fp16 | bf16 | powersgd (DDP communication hooks)
    matrix_approximation_rank: int = 1  # powersgd: rank r of the factors P (n x r), Q (m x r)
    start_powerSGD_iter: int = 1000  # powersgd: plain all-reduce steps before compression starts (>= 2)
    pipeline_stages: int = 2  # pipeline: stages S; dist.nproc x nnodes = replicas x S processes
    microbatches: int = 4  # pipeline: micro-batches M of each replica's batch per step
    pipeline_schedule: str = "1f1b"  # pipeline: gpipe | 1f1b
    pipeline_split: str = ""  # pipeline: blocks per stage, e.g. "3,1"; "" = as even as the model cuts itself
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after forward (ZeRO-3); false: ZeRO-2
    num_ps: int = 1  # ps-*: parameter-server processes per node
    backup_workers: int = 0  # ps-sync: aggregate the first W - b gradients of a step (Chen et al. 2016)
    max_staleness: int = -1  # ps-async: bound on update staleness in versions; -1 = unbounded
    staleness_lr: bool = False  # ps-async: lr / staleness (Zhang et al. 2016)
    slow_rank: int = -1  # straggler injection: this rank sleeps slow_ms before every step
    slow_ms: float = 0.0
    devices: str = ""  # replicate: tower devices, e.g. "cpu:0,cpu:1" or "cuda:0,cuda:1"
    visible_devices: str = ""  # CUDA devices this job may see ("0,2"), the CUDA_VISIBLE_DEVICES way
    strict_placement: bool = False  # a device that does not exist is an error (default: fall back, warn)
    log_placement: bool = False  # print and record which device holds each parameter (and tower)
    interop_threads: int = 0  # inter-op threads per process; 0 = torch's default
    memory_fraction: float = 0.0  # CUDA: torch.cuda.set_per_process_memory_fraction; 0 = off
    expandable_segments: bool = False  # CUDA: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    cpu_allocator: str = "retain"  # host memory: retain (glibc reuses freed blocks) | default; devices.py
    check_sync_every: int = 0  # steps between cross-rank parameter checksums; 0 = off
    fault: str = ""  # fault injection, e.g. "kill:rank=1:step=50,delay:rank=0:ms=200" (see paratrain.faults)

    def __post_init__(self) -> None:
        from .strategies import STRATEGIES

        check_choice("dist", "strategy", self.strategy, tuple(STRATEGIES))
        check_at_least("dist", "nproc", self.nproc, 1)
        check_at_least("dist", "nnodes", self.nnodes, 1)
        check_at_least("dist", "threads", self.threads, 0)
        check_choice("dist", "cpu_allocator", self.cpu_allocator, CPU_ALLOCATORS)
        check_at_least("dist", "max_restarts", self.max_restarts, 0)
        check_at_least("dist", "rdzv_timeout_s", self.rdzv_timeout_s, 1)
        check_at_least("dist", "bucket_mb", self.bucket_mb, 0, strict=True)
        check_at_least("dist", "num_ps", self.num_ps, 1)
        check_at_least("dist", "pipeline_stages", self.pipeline_stages, 1)
        check_at_least("dist", "microbatches", self.microbatches, 1)
        check_choice("dist", "pipeline_schedule", self.pipeline_schedule, ("gpipe", "1f1b"))
        from .strategies.comm_hooks import check_options

        check_options(self.comm_hook, self.matrix_approximation_rank, self.start_powerSGD_iter)
        check_at_least("dist", "backup_workers", self.backup_workers, 0)
        check_at_least("dist", "max_staleness", self.max_staleness, -1)
        check_at_least("dist", "slow_ms", self.slow_ms, 0)
        check_at_least("dist", "check_sync_every", self.check_sync_every, 0)
        from .faults import parse

        parse(self.fault)
        if not 0 <= self.memory_fraction <= 1:
            raise UsageError(f"dist.memory_fraction = {self.memory_fraction!r} is out of range; use a value in [0, 1]")
        check_at_least("dist", "interop_threads", self.interop_threads, 0)
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"dist.node_rank = {self.node_rank} is out of range; use 0 .. {self.nnodes - 1}"
            )
        check_choice("dist", "backend", self.backend, ("auto", "gloo", "nccl"))
        check_choice("dist", "device", self.device, ("auto", "cpu", "cuda"))
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise UsageError("dist.nnodes > 1 needs dist.rdzv_endpoint (host:port of node 0)")
        self._check_owned_keys()
        STRATEGIES[self.strategy].check_dist(self)

    def _check_owned_keys(self) -> None:
        """A strategy-specific key (``Strategy.dist_keys``) set for a strategy that does not read it."""
        from .strategies import STRATEGIES, owners

        defaults = DistConfig.__dataclass_fields__
        for key in sorted({k for cls in STRATEGIES.values() for k in cls.dist_keys}):
            if getattr(self, key) != defaults[key].default and key not in STRATEGIES[self.strategy].dist_keys:
                names = owners(key)
                raise UsageError(f"dist.{key} applies to --strategy {' or '.join(names)} only; drop it or use "
                                 f"{names[0] if len(names) == 1 else 'one of them'}")

    @property
    def towers(self) -> int:
        """Replicas per process (tower mode), as the strategy counts them."""
        from .strategies import STRATEGIES

        return STRATEGIES[self.strategy].towers(self)
