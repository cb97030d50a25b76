"""``pipeline``: pipeline parallelism across processes, with data parallelism beside it (``dist.nproc``
= D x S processes on a 2-D DeviceMesh ``("dp", "pp")``), on ``torch.distributed.pipelining``.

The model is cut into S = ``dist.pipeline_stages`` consecutive stages by :mod:`.stages`: its
``pipeline_stages(S)`` method (the ``gpt`` model: embeddings + first blocks, ..., last blocks +
head), else an ``nn.Sequential``'s children, with ``dist.pipeline_split = "n_0,...,n_{S-1}"`` the
blocks (layers) of each stage (the stage plan; e.g. fewer blocks on the stage that holds a large
output layer). Process ``d x S + s`` runs stage s of data-parallel replica d. Each replica's share
of the global batch (B / D windows) is split into M = ``dist.microbatches`` micro-batches that flow
through the stages under the ``dist.pipeline_schedule``: ``gpipe`` (all forwards, then all
backwards; Huang et al. 2019, "GPipe") or ``1f1b`` (one forward, one backward in the steady state,
at most S micro-batches in flight; Narayanan et al. 2019, "PipeDream"). Activations travel between
stages by point-to-point send/recv; an idle stage waits (the bubble, (S-1)/(M+S-1) of a step for
both schedules).

The last stage computes the task's own loss on each micro-batch's output (normalised by the global
batch's units / D, as every strategy does), the schedule sums the micro-batch gradients
(``scale_grads=False``), so that after the step:

* a parameter used by several stages (gpt's tied embedding / output projection, Press & Wolf 2017)
  gets the sum of its stages' gradients (an all-reduce over the pipeline group, as Megatron-LM does
  for its word embeddings), and every copy updates identically;
* each stage's gradients are averaged over the D replicas (all-reduce over the ``dp`` group).

The result equals one device with the same global batch (tested in float64). The optimizer you
give holds the whole model; on each process only its stage's parameters get gradients and
optimizer state. Evaluation, ``state_dict`` and the non-finite check see the whole model: each
stage's parameters are broadcast to the other stages of its replica first. Checkpoints are DCP
folders (:mod:`.sharded`): each stage writes its own parameters and optimizer state.

``train.precision = "bf16"`` runs the stages under autocast (gpt's activations between stages stay in
the parameters' dtype, float32 by default: its residual stream adds to the embeddings' output).
``"fp16"`` does too, and the last stage scales each micro-batch's loss with a
``ShardedGradScaler`` before the schedule's backward; every stage unscales its own gradients and the
inf/NaN flag is all-reduced over the job, so every process skips the same steps.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .allreduce import AllReduce
from .sharded import ShardedCheckpoints, by_index, local_by_name, parameter_names, read_whole
from .stages import cut_stages, split_blocks, task_hooks
from .step import StepResult
from .wrapping import base_load_state_dict

SCHEDULES = ("gpipe", "1f1b")


class _Given(nn.Module):
    """A "model" whose forward returns the stage output it was made with: the task's loss function
    runs unchanged on the pipeline's output for one micro-batch."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.output


class Pipeline(ShardedCheckpoints, AllReduce):
    """Options: ``pipeline_stages`` (S, default 2), ``microbatches`` (M, default 4),
    ``pipeline_schedule`` (``gpipe`` or ``1f1b``, default ``1f1b``)."""

    name = "pipeline"
    dist_keys = ("pipeline_stages", "microbatches", "pipeline_schedule", "pipeline_split")
    cost_model = "stages"  # paratrain.bench.costmodel_pipeline.predict_pipeline
    rank_local_gradients = True  # fp16: each stage checks its own gradients; ShardedGradScaler shares the flag
    task = None  # the trainer's Task (set before setup): how a micro-batch is fed and cut
    @classmethod
    def options(cls, cfg) -> dict[str, Any]:
        return {k: getattr(cfg.dist, k) for k in cls.dist_keys}

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        d, t = cfg.dist, cfg.train
        world = d.nproc * d.nnodes
        if d.pipeline_stages < 2 or world % d.pipeline_stages:
            raise UsageError(f"dist.pipeline_stages = {d.pipeline_stages} with {world} processes: use 2 or more "
                             f"stages that divide the number of processes (data-parallel replicas x stages)")
        if t.accumulation != 1:
            raise UsageError("strategy 'pipeline' splits each step into dist.microbatches itself; set "
                             "train.accumulation = 1 and use dist.microbatches")
        if cfg.placement:
            raise UsageError("strategy 'pipeline' places the stages on processes itself; remove [placement]")
        split_blocks(d.pipeline_split, d.pipeline_stages)

    @classmethod
    def check_global_batch(cls, cfg) -> None:
        d, b = cfg.dist, cfg.train.batch_size
        replicas = d.nproc * d.nnodes // d.pipeline_stages
        if b % (replicas * d.microbatches):
            raise UsageError(f"global batch {b} does not split into {replicas} replica(s) x "
                             f"{d.microbatches} micro-batches; use a multiple of {replicas * d.microbatches} for "
                             f"train.batch_size or change dist.microbatches")

    def prepare_own_loop(self, batch_dim: int) -> None:
        """``pt.train_step``'s batches: rows along dimension 0, cut by TaskBase's defaults."""
        if batch_dim != 0:
            raise UsageError(f"strategy 'pipeline' cuts each batch into micro-batches along dimension 0, not "
                             f"batch_dim={batch_dim}: lay the rows of your batches along dimension 0")
        from types import SimpleNamespace

        self.task = SimpleNamespace(batch_dim=0)

    def check_rows(self, rows: int) -> None:
        """``pt.train_step``'s batch of ``rows`` rows: a multiple of the micro-batches, and the same every
        step (the stages fix their shapes at the first step). UsageError otherwise."""
        m = int(self.options.get("microbatches", 4))
        if rows % m:
            raise UsageError(f"a batch of {rows} rows does not split into dist.microbatches = {m} micro-batches: "
                             f"give pt.train_step batches of a multiple of {m} rows (drop a last partial batch)")
        first = getattr(self, "_rows", None)
        if first is not None and rows != first:
            raise UsageError(f"a batch of {rows} rows after batches of {first}: the pipeline's stages keep the shapes "
                             f"of the first step; give pt.train_step batches of one size (drop a last partial batch)")
        self._rows = rows

    @classmethod
    def data_parallel_ranks(cls, dist) -> int:
        return max(1, dist.nproc * dist.nnodes // dist.pipeline_stages)

    @classmethod
    def dist_for_replicas(cls, n: int) -> dict[str, Any]:
        return {"nproc": 2 * n, "pipeline_stages": 2}

    # ---- the job's layout ------------------------------------------------------------------------
    @property
    def stages(self) -> int:
        return int(self.options.get("pipeline_stages", 2))

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas D = world_size / S: the merge averages over them."""
        return self.env.world_size // self.stages

    @property
    def stage_index(self) -> int:
        return self.env.rank % self.stages

    def data_share(self) -> tuple[int, int]:
        """Every stage of replica d reads replica d's share of the data (stage 0 its inputs, the last
        stage its targets)."""
        return self.env.rank // self.stages, self.num_replicas

    def _wrap(self, module: nn.Module, batch_dim: int) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if self.env.world_size < 2 or not dist.is_initialized():
            raise UsageError("strategy 'pipeline' runs one stage per process; start it with paratrain train "
                             "--nproc N (N = replicas x dist.pipeline_stages)")
        if self.task is None:
            raise UsageError("strategy 'pipeline' needs to know how a batch is fed and cut: run it under "
                             "paratrain train (the Task API), or with pt.setup and pt.train_step in your own loop")
        parts = cut_stages(module, self.stages, self.options.get("pipeline_split", ""))  # the model's reason first
        self._input, self._chunk = task_hooks(self.task)
        self.mesh = init_device_mesh(self.device.type, (self.num_replicas, self.stages), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = self.mesh["pp"].get_group(), self.mesh["dp"].get_group()
        owners: dict[int, list[int]] = {}
        for s, part in enumerate(parts):
            for p in part.parameters():
                owners.setdefault(id(p), []).append(s)
        params = list(module.parameters())
        me = self.stage_index
        self.stage_params = [p for p in params if me in owners.get(id(p), [])]
        self.stage_of = [[p for p in params if s in owners.get(id(p), [])] for s in range(self.stages)]
        self.shared = [p for p in params if len(owners.get(id(p), [])) > 1]  # summed over the pp group
        self.counted_elsewhere = {id(p) for p in self.shared if owners[id(p)][0] != me}  # for the norm
        self.part = parts[me]
        self.pp_stage = PipelineStage(self.part, me, self.stages, self.device, group=self.pp_group)
        kind = self.options.get("pipeline_schedule", "1f1b")
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
        self.schedule = cls(self.pp_stage, n_microbatches=int(self.options.get("microbatches", 4)),
                            loss_fn=self._chunk_loss, scale_grads=False)
        self._step_loss: Callable | None = None
        self._busy_s, self.bubble, self.bubbles = 0.0, float("nan"), [float("nan")] * self.stages
        self._forwards = self._losses = 0  # this step's micro-batch forwards and losses (last stage)
        for name in ("forward_one_chunk", "backward_one_chunk"):  # this stage's compute, timed per call
            setattr(self.pp_stage, name, self._timed(getattr(self.pp_stage, name), name == "forward_one_chunk"))
        return module

    whole_current = True  # every process holds every stage's current parameters (after gather_whole)

    def begin_step(self) -> None:
        """The wrapped model's training forward would run the whole model on every process, its
        gradients never merged: refused (the schedule runs each stage's forwards in train_step)."""
        raise UsageError("under strategy 'pipeline' each process runs one stage inside the schedule: train "
                         "with pt.train_step(batch, loss_fn) instead of model(x), loss.backward(), optimizer.step()")

    def before_plain_forward(self) -> None:
        if not self.whole_current:
            raise UsageError("under strategy 'pipeline' each process updated only its own stage: call "
                             "pt.gather_model() on every rank before evaluating the model")

    def _timed(self, fn: Callable, forward: bool) -> Callable:
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            self._forwards += forward
            try:
                return fn(*args, **kwargs)
            finally:
                self._busy_s += time.perf_counter() - t0
        return run

    def metrics(self) -> dict[str, float]:
        """``bubble_stage<s>``: of the last step's schedule time on stage s, the part its compute (the
        forward and backward of each micro-batch) did not fill: waiting for the other stages and
        point-to-point transfers; ``bubble_fraction``: their mean; ``bubble_theory``: (S-1)/(M+S-1),
        the bubble of S equal stages without transfer time."""
        m = int(self.options.get("microbatches", 4))
        per = {f"bubble_stage{s}": round(b, 4) for s, b in enumerate(self.bubbles)}
        return {"bubble_fraction": round(sum(self.bubbles) / len(self.bubbles), 4),
                "bubble_theory": round((self.stages - 1) / (m + self.stages - 1), 4), **per}

    def _dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def _groups(self) -> list:
        return [self.pp_group, self.dp_group]

    def describe(self) -> list[str]:
        return [f"pipeline: stage {self.stage_index} of {self.stages} ({len(self.stage_params)} parameter tensors), "
                f"replica {self.env.rank // self.stages} of {self.num_replicas}, "
                f"{self.options.get('microbatches', 4)} micro-batches, {self.options.get('pipeline_schedule')}"]

    # ---- the step --------------------------------------------------------------------------------
    def _chunk_loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch (last stage): the trainer's loss function on the
        micro-batch's rows ``index`` of this replica's batch, with the stage output as the model's."""
        if self._forwards <= self._losses:  # the schedule's shape inference (first step) on placeholder
            outs = output if isinstance(output, (tuple, list)) else (output,)  # inputs: not a micro-batch of the
            return sum(o.float().sum() for o in outs  # data, kept out of the task's loss log
                       if isinstance(o, torch.Tensor) and o.is_floating_point())
        self._losses += 1
        lo, hi = int(index[0]), int(index[-1]) + 1
        loss = self._step_loss(_Given(output), self._chunk(self._batch, lo, hi))
        return loss if self.scaler is None else self.scaler.scale(loss)  # fp16: the schedule's backward is scaled

    def train_step(self, micro_batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                   clip: float = 0.0) -> StepResult:
        """One optimizer step of this process' stage: the schedule's forwards and backwards over the M
        micro-batches of this replica's batch, the shared parameters' gradients summed over the
        stages, the stage's gradients averaged over the replicas, clipping by the global norm of the
        whole model's merged gradient, ``optimizer.step()``. Every rank must call it."""
        c = self.clock
        (self._batch,) = micro_batches  # accumulation is 1 (check_config): the micro-batches are M
        self._step_loss = loss_fn
        losses: list[torch.Tensor] = []
        t0 = c.mark()
        first, last = self.pp_stage.is_first, self.pp_stage.is_last
        self._busy_s, w0 = 0.0, time.perf_counter()
        self._forwards = self._losses = 0
        self.whole_current = False  # from here, the other stages' parameters on this process are stale
        with self.autocast():
            x = self._input(self._batch)  # every stage: the rows' count; stage 0 feeds it
            index = torch.arange(x.size(0), device=self.device)
            # return_outputs=False: the losses are all the step needs; merging the last stage's
            # micro-batch outputs (gpt_wt2: 4 x 68 MB of logits) cost a fifth of its step
            if first:
                self.schedule.step(x, target=index if last else None, losses=losses, return_outputs=False)
            elif last:
                self.schedule.step(target=index, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        wall = time.perf_counter() - w0
        self.bubble = max(0.0, 1.0 - self._busy_s / wall) if wall > 0 else float("nan")
        t1 = c.mark()
        self._merge()
        t2 = c.mark()
        # one all-reduce over the stages: the loss (the last stage's) for every stage's log, and each bubble
        shared = torch.zeros(1 + self.stages, dtype=torch.float64, device=self.device)
        if losses:
            shared[0] = torch.stack(losses).sum().detach().double()
            if self.scaler is not None:
                shared[0] /= self.scaler.get_scale()  # a power of two: exact
        shared[1 + self.stage_index] = self.bubble
        dist.all_reduce(shared, group=self.pp_group)
        total, self.bubbles = shared[0].to(self._dtype()), shared[1:].tolist()
        t3 = c.mark()
        if clip > 0:
            self.clip_grad_norm_(clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t4 = c.mark()
        rec = self.last_step
        spans = [("compute", t0, t1), ("comm", t1, t2), ("optimizer", t3, t4)]
        return StepResult(total, rec.norm, spans + rec.spans, (t1, t2), skipped=rec.skipped)

    def _merge(self) -> None:
        """Shared parameters: sum of their stages' gradients (pp group; stages without them add zeros).
        Then this stage's gradients: mean over the data-parallel replicas (dp group)."""
        if self.shared:
            mine = {id(p) for p in self.stage_params}
            flat = torch.cat([(p.grad if id(p) in mine and p.grad is not None else torch.zeros_like(p)).reshape(-1)
                              for p in self.shared])
            dist.all_reduce(flat, group=self.pp_group)
            self._unflatten(flat, [p for p in self.shared if id(p) in mine], grads=True, all_params=self.shared)
        if self.num_replicas > 1:
            params = [p for p in self.stage_params if p.grad is not None]
            if params:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat, group=self.dp_group)
                flat /= self.num_replicas
                self._unflatten(flat, params, grads=True)

    @staticmethod
    def _unflatten(flat: torch.Tensor, targets: list, *, grads: bool, all_params: list | None = None) -> None:
        """Copy ``flat`` (the concatenation of ``all_params``, default ``targets``) into the gradients
        (``grads``) or values of ``targets``."""
        want = {id(p) for p in targets}
        off = 0
        for p in all_params or targets:
            n = p.numel()
            if id(p) in want:
                piece = flat[off:off + n].view_as(p)
                if grads:
                    if p.grad is None:
                        p.grad = piece.clone()
                    else:
                        p.grad.copy_(piece)
                else:
                    p.data.copy_(piece)
            off += n

    def _grad_norm(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's merged-gradient 2-norm: this stage's part (a shared parameter counted on
        its first stage only) all-reduced over the pipeline group."""
        if norm_type != 2.0:
            raise UsageError("strategy 'pipeline' clips by the 2-norm only")
        skip = {id(p.grad) for p in self.stage_params if id(p) in self.counted_elsewhere and p.grad is not None}
        own = {id(p.grad) for p in self.stage_params if p.grad is not None}
        mine = [g for g in grads if id(g) in own and id(g) not in skip]
        # this stage's part as one device computes the whole (get_total_norm, in the gradients' dtype: no
        # copy of them; a float64 copy and its square held 4 x the largest float32 gradient, gpt_wt2's
        # stage 0 peaked there), its square summed over the stages in float64
        part = nn.utils.get_total_norm(mine, 2.0, foreach=True) if mine else torch.zeros((), device=self.device)
        sq = part.detach().double().pow(2)
        dist.all_reduce(sq, group=self.pp_group)
        return sq.sqrt().to(grads[0].dtype if grads else torch.float32)

    # ---- the whole model on every stage ------------------------------------------------------------
    def gather_whole(self) -> None:
        """Every stage's parameters broadcast to the other stages of this replica (pp group), so that
        each process holds the whole current model. Every rank must call it."""
        for s, params in enumerate(self.stage_of):
            if not params:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, group=self.pp_group, group_src=s)
            if s != self.stage_index:
                self._unflatten(flat, params, grads=False)
        self.whole_current = True

    def before_eval(self) -> None:
        self.gather_whole()

    def nonfinite_parameters(self) -> list[str]:
        """Names of non-finite parameters of any stage (every rank agrees: gathered over the job)."""
        own = {id(p) for p in self.stage_params}
        bad = [n for n, p in self.module.named_parameters() if id(p) in own and not bool(torch.isfinite(p).all())]
        return sorted({n for names in self.all_gather_object(bad) for n in names})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model (call :meth:`gather_whole` on every rank first: evaluation does)."""
        return self.module.state_dict()

    # ---- checkpoints ------------------------------------------------------------------------------
    def sharded_state(self) -> dict[str, Any]:
        """This stage's parameters (and the model's buffers) and their optimizer state, by name."""
        own = {id(p) for p in self.stage_params}
        model = {n: t for n, t in self.module.state_dict(keep_vars=True).items()
                 if not isinstance(t, nn.Parameter) or id(t) in own}
        state = {p: s for p, s in self.optimizer.state.items() if id(p) in own}
        return {"model": {n: t.detach() for n, t in model.items()},
                "optim": local_by_name(self.optimizer, parameter_names(self.module, self.optimizer), state)}

    def load_sharded(self, path) -> None:
        whole = read_whole(path)
        self.load_whole(whole["model"], by_index(whole["optim"], parameter_names(self.module, self.optimizer)))

    def load_whole(self, model: dict, optim: dict) -> None:
        """Load a whole model and a whole by-index optimizer state (any strategy's) on every stage."""
        self.module.load_state_dict(model)
        base_load_state_dict(self.optimizer, optim)
        self.whole_current = True

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Load a whole plain state_dict on every process (each then holds the whole current model)."""
        out = super().load_state_dict(state, strict)
        self.whole_current = True
        return out
