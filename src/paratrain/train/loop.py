"""The training loop: one loop for every strategy (``fit``).

Per optimizer step: set the learning rate, hand this rank's micro-batches to
``strategy.train_step`` (forward, backward, gradient merge, clip, update), count
words. Around it: validation after every epoch (and every ``eval_every``
steps), checkpoints every ``checkpoint_every`` steps and at epoch end, metrics
every ``log_every`` steps, test perplexity at the end, a one-screen summary.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..bench.timing import RankTimer, breakdown, write_rank_timing
from ..config import Config
from ..consistency import check_ranks, check_sync, config_text
from ..data import (BPTTTrainStream, SentenceTrainStream, batch_source, bptt_eval_batches,
                    ensure_corpus, load_corpus, sentence_eval_batches)
from ..devices import (Placement, apply_memory_controls, apply_placement, format_placement_log, peak_memory_bytes,
                       resolve_list)
from ..env import DistEnv
from ..errors import TrainingStopped, UsageError
from ..faults import inject as inject_faults
from ..faults import parse as parse_faults
from ..faults import poisoned
from ..models import LSTMLM
from ..strategies import IndependentReplicasMixin, get_strategy
from ..watchdog import Watchdog, is_comm_failure
from . import checkpoint
from .metrics import MetricsLog, format_summary, perplexity
from .optim import LRSchedule, build_optimizer, effective_lr_clip, scaling_factor
from .task import LMTask, evaluate


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """Builds model, optimizer, schedule, strategy and data for one rank and runs ``fit``.

    Every rank constructs one and calls :meth:`fit` (collective). Rank 0 alone
    prints and writes into ``run_dir``.
    """

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path, data_dir: str | None = None,
                 verbose: bool = True, strategy_options: dict | None = None) -> None:
        self.cfg, self.env, self.run_dir = cfg, env, Path(run_dir)
        self.verbose = verbose
        d, t = cfg.data, cfg.train
        corpus = load_corpus(ensure_corpus(d.corpus, data_dir, allow_download=False))
        self.vocab_size = len(corpus.vocab)
        self.train_split = corpus.train.head(d.train_fraction)
        self.valid_split, self.test_split = corpus.valid.head(d.eval_fraction), corpus.test.head(d.eval_fraction)
        torch.manual_seed(t.seed)  # same initial parameters on every rank and in single
        m = cfg.model
        model = LSTMLM(self.vocab_size, m.embed_dim, m.hidden_dim, m.num_layers, m.dropout,
                       m.tie_weights, m.init_range, m.layerwise).to(getattr(torch, t.dtype))
        options = dict(strategy_options or {})
        if cfg.dist.devices:
            options["devices"] = resolve_list(cfg.dist.devices, cfg.dist.strict_placement)
        self.placement = []
        if cfg.placement:  # model parallel: modules on the plan's devices, activations follow
            self.placement = apply_placement(model, dict(cfg.placement), str(env.device), cfg.dist.strict_placement)
            options["placed"] = True
        self.strategy = get_strategy(cfg.dist.strategy, env, bucket_mb=cfg.dist.bucket_mb, **options)
        T = d.bptt if d.mode == "bptt" else 1
        lr, self.clip = effective_lr_clip(t, T)
        optimizer = build_optimizer(model.parameters(), t, lr)
        self.schedule = LRSchedule(t, lr, scaling_factor(t.lr_scaling, t.batch_size, t.ref_batch_size or t.batch_size))
        self.log = MetricsLog(self.run_dir) if env.is_main else None
        for note in apply_memory_controls(env.device, cfg.dist.memory_fraction, cfg.dist.expandable_segments):
            self.say(note)
        self.strategy.setup(model, optimizer)
        self.synced = not isinstance(self.strategy, IndependentReplicasMixin) and env.world_size > 1
        if self.synced:  # every rank: same model, config and versions (collective)
            check_ranks(self.strategy.module, config_text(cfg), env.world_size)
        if cfg.dist.log_placement:
            self._log_placement()
        self.task = LMTask()
        self.stream = self._train_stream()
        self.step, self.epoch, self.batch_index = 0, 1, 0
        self.progress = verbose and env.is_main
        self.words = 0  # target tokens of the global batches rank 0 has stepped through
        self._log_words = 0
        self.train_time_s = 0.0
        self.results: dict[str, float] = {}
        self.timer = RankTimer(self.strategy.clock)
        # replicas that wait for each other: name the missing rank when a collective times out
        self.watchdog = Watchdog(env.rank, env.world_size if not isinstance(self.strategy, IndependentReplicasMixin)
                                 else 1, t.timeout_s)
        self.nonfinite_steps = 0
        self._interval_start = 0  # first step of the current logging interval
        self._measured_words, self._measured_time_s = 0, 0.0  # intervals after timing warm-up

    def dropout_seed(self, step: int) -> int:
        """Seed of step ``step``'s dropout masks: a function of (seed, rank, step) only, so ranks draw
        different masks and a resumed run draws the same ones (no RNG state to save)."""
        return self.cfg.train.seed * 1_000_003 + self.env.rank * 7919 + step

    @property
    def micro_per_step(self) -> int:
        """Micro-batches of this rank per optimizer step: accumulation x towers."""
        return self.cfg.train.accumulation * self.strategy.towers

    def _train_stream(self):
        d, t, env = self.cfg.data, self.cfg.train, self.env
        if d.mode == "bptt":
            return BPTTTrainStream(self.train_split, t.batch_size, d.bptt, env.rank, env.world_size, self.micro_per_step)
        return SentenceTrainStream(self.train_split, t.batch_size, env.rank, env.world_size, self.micro_per_step,
                                   t.seed, d.max_sentence_len)

    @property
    def total_steps(self) -> int:
        t = self.cfg.train
        full = t.epochs * self.stream.steps_per_epoch
        return min(full, t.max_steps) if t.max_steps else full

    def _log_placement(self) -> None:
        """Print and write (placement.txt) which device holds each parameter, and the towers."""
        rows = self.placement or [Placement(n, str(p.device), p.numel(), p.numel() * p.element_size())
                                  for n, p in self.strategy.module.named_parameters()]
        text = format_placement_log(rows)
        describe = getattr(self.strategy, "describe_towers", None)
        if describe is not None:
            text += "\n" + "\n".join(describe())
        if self.env.is_main:
            (self.run_dir / "placement.txt").write_text(text + "\n")
            self.say("placement:\n" + text)

    def say(self, msg: str) -> None:
        if self.env.is_main and self.verbose:
            from tqdm import tqdm

            tqdm.write(f"[rank {self.env.rank}] {msg}")

    # ---- checkpoints -------------------------------------------------------
    def save(self) -> None:
        self.timer.reset_arrival()  # time spent here is not waiting in the next step's collective
        self.watchdog.at(self.step, "checkpoint")
        hidden = {}
        if self.cfg.data.mode == "bptt" and not isinstance(self.strategy, IndependentReplicasMixin):
            hidden = self.task.gather_hidden(self.cfg.train.batch_size, self.env.rank, self.env.world_size,
                                             self.micro_per_step, self.strategy.all_reduce)  # collective
        bad = [n for n, p in self.strategy.module.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:  # every rank holds the same parameters: all stop; never write a checkpoint one cannot resume from
            raise TrainingStopped(f"parameters {bad[:3]} are not finite at step {self.step}; no checkpoint "
                                  f"written, the previous one is kept")
        if self.env.is_main:
            state = {"model": self.strategy.state_dict(), "optimizer": self.strategy.optimizer_state_dict(),
                     "schedule": self.schedule.state_dict(), "epoch": self.epoch,
                     "batch_index": self.batch_index, "hidden": hidden,
                     "words": self.words, "train_time_s": self.train_time_s}
            checkpoint.save(self.run_dir, state, self.step, keep=self.cfg.train.keep_checkpoints)

    def restore(self, path: Path) -> None:
        """Load model, optimizer, schedule, position and hidden state (every rank)."""
        state = checkpoint.load(path)
        try:
            self.strategy.load_state_dict(state["model"])
        except RuntimeError as e:
            raise UsageError(f"checkpoint {path} does not fit this model ({str(e).splitlines()[0][:120]}); "
                             f"resume with the config it was written with") from None
        self.strategy.load_optimizer_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.step, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch_index"]
        self.words, self.train_time_s = state.get("words", 0), state.get("train_time_s", 0.0)
        self._log_words = self.words
        self._interval_start = self.step
        self.task.scatter_hidden(state.get("hidden", {}), self.cfg.train.batch_size, self.env.rank,
                                 self.env.world_size, self.micro_per_step, self.env.device,
                                 getattr(torch, self.cfg.train.dtype))
        self.say(f"resumed from {path.name}: step {self.step}, epoch {self.epoch}, batch {self.batch_index}")
        if self.log:
            self.log.write("resume", self.step, epoch=self.epoch, batch_index=self.batch_index, checkpoint=path.name)

    # ---- evaluation --------------------------------------------------------
    def evaluate(self, split_name: str) -> float:
        """Perplexity of a whole split; every rank must call it (all-reduce)."""
        d, env = self.cfg.data, self.env
        self.timer.reset_arrival()
        self.watchdog.at(self.step, "evaluation")
        split = self.valid_split if split_name == "valid" else self.test_split
        rank, world = env.rank, env.world_size
        if isinstance(self.strategy, IndependentReplicasMixin):  # no collectives: rank 0 evaluates alone
            rank, world = (0, 1) if env.rank == 0 else (0, 0)
        if world == 0:
            batches = []
        elif d.mode == "bptt":
            batches = bptt_eval_batches(split, d.eval_batch_size, d.bptt, rank, world)
        else:
            batches = sentence_eval_batches(split, d.eval_batch_size, rank, world, d.max_sentence_len)
        self.strategy.before_eval()
        acc = self.strategy.all_reduce(evaluate(self.strategy.module, batches, env.device))
        loss = float(acc[0] / acc[1]) if acc[1] > 0 else math.nan
        ppl = perplexity(loss)
        self.results[f"{split_name}_ppl"] = ppl
        if self.log:
            self.log.write(split_name, self.step, epoch=self.epoch, **{f"{split_name}_loss": loss, f"{split_name}_ppl": ppl})
        where = f"epoch {self.epoch}" if self.batch_index else f"end of epoch {self.epoch - 1}"
        self.say(f"step {self.step} ({where}): {split_name} perplexity {ppl:.2f}")
        return loss

    # ---- training ----------------------------------------------------------
    def _nonfinite(self, local_loss: torch.Tensor) -> None:
        """The merged gradient of the step just taken was NaN/Inf and no update was made: find the
        ranks whose loss was not finite (collective where replicas step together), count, log,
        and stop the run when ``train.on_nonfinite = "stop"``."""
        flags = torch.zeros(self.env.world_size, dtype=torch.float64, device=self.env.device)
        flags[self.env.rank] = float(not bool(torch.isfinite(local_loss)))
        ranks = [int(r) for r in torch.nonzero(self.strategy.all_reduce(flags)).flatten().tolist()]
        self.nonfinite_steps += 1
        step = self.step  # 0-based index of the step: the loop has not counted it yet
        what = f"non-finite loss on rank(s) {ranks}" if ranks else "non-finite gradient (losses finite)"
        if self.log:
            self.log.write("nonfinite", step, ranks=ranks, action=self.cfg.train.on_nonfinite,
                           count=self.nonfinite_steps)
        if self.cfg.train.on_nonfinite == "stop":
            raise TrainingStopped(f"{what} at step {step}; the parameters are unchanged since the last step "
                                  f"(use --on-nonfinite skip to skip such steps)")
        self.say(f"{what} at step {step}: update skipped ({self.nonfinite_steps} so far)")

    def _step_times(self) -> tuple[dict[str, float], bool]:
        """Resolve this interval's step spans, split idle off communication (collective among
        the replicas that wait for each other) and return the interval's mean ms per step."""
        arrivals = self.timer.flush()
        peak = self.strategy.peer_max(torch.tensor(arrivals, dtype=torch.float64, device=self.env.device)).cpu()
        counted = self._interval_start >= self.cfg.train.timing_warmup_steps
        self._interval_start = self.step
        return self.timer.finish_interval(arrivals, peak.tolist(), counted), counted

    def _log_train(self, t_last: float, words_last: int, lr: float, bar) -> None:
        """Global mean training loss since the last record (collective), words/s, step time breakdown."""
        times, counted = self._step_times()
        ce, n = self.task.take_log_counts()
        acc = self.strategy.all_reduce(torch.stack([ce.to(self.env.device), ce.new_tensor(float(n)).to(self.env.device)]))
        loss = float(acc[0] / acc[1]) if acc[1] > 0 else math.nan
        if not self.log:
            return
        words = self.strategy.words_trained(self.words, self.step)
        dt = max(self.train_time_s - t_last, 1e-9)
        wps = (words - words_last) / dt
        if counted:
            self._measured_words += words - words_last
            self._measured_time_s += dt
        self._log_words = words
        self.log.write("train", self.step, epoch=self.epoch, loss=loss, ppl=perplexity(loss), lr=lr, words_per_s=wps,
                       **{k: round(v, 4) for k, v in times.items()}, **self.strategy.metrics())
        if bar is not None:
            bar.set_postfix_str(f"loss {loss:.3f} | ppl {perplexity(loss):.1f} | lr {lr:.3g} | {wps:,.0f} words/s")

    def _run_epoch(self, bar) -> bool:
        """Train from the current position to the end of the epoch or max_steps. True if the epoch ended."""
        t, env = self.cfg.train, self.env
        if self.batch_index == 0:
            self.task.reset_hidden()  # Zaremba et al.: the state starts at zero every epoch
        batches = self.stream.epoch(self.epoch, self.batch_index)
        source = batch_source(batches, env.device)  # GPU: prefetched in a thread; CPU: direct
        t_log, w_log = self.train_time_s, self._log_words
        lr = self.schedule.lr(self.step, self.epoch)
        slow_s = self.cfg.dist.slow_ms / 1000 if env.rank == self.cfg.dist.slow_rank else 0.0
        faults = parse_faults(self.cfg.dist.fault)
        clock, it = self.strategy.clock, iter(source)
        try:
            tick = time.perf_counter()
            while True:
                self.watchdog.at(self.step, "before the step")
                m0 = clock.mark()
                sb = next(it, None)
                if sb is None:
                    break
                m1 = clock.mark()
                spans = [("data", m0, m1)]
                lr = self.schedule.apply(self.strategy.optimizer, self.step, self.epoch)
                self.task.norm = sb.global_tokens / self.strategy.num_replicas
                if self.cfg.model.dropout > 0:  # dropout masks depend on (seed, rank, step) only: exact resume
                    torch.manual_seed(self.dropout_seed(self.step))
                if slow_s:  # straggler injection (--slow-rank/--slow-ms): slower compute
                    m2 = clock.mark()
                    time.sleep(slow_s)
                    spans.append(("compute", m2, clock.mark()))
                loss_fn = self.task.loss_fn
                if faults and inject_faults(faults, env.rank, self.step):  # --fault nan: this rank's loss is NaN
                    loss_fn = poisoned(loss_fn)
                self.watchdog.at(self.step, "gradient all-reduce")
                res = self.strategy.train_step(sb.micro, loss_fn, self.clip)
                if res.skipped:
                    self._nonfinite(res.loss)
                self.step, self.batch_index = self.step + 1, sb.index + 1
                self.words += sb.global_tokens
                if bar is not None:
                    bar.update(1)
                self.timer.add(self.step - 1, m0, clock.mark(), spans + res.spans, res.collective)
                stop = self.strategy.finished(self.step, self.total_steps)
                if self.synced and self.cfg.dist.check_sync_every and self.step % self.cfg.dist.check_sync_every == 0:
                    self.watchdog.at(self.step - 1, "logging all-reduce")
                    check_sync(self.strategy.module, self.strategy.all_reduce, env.rank, env.world_size, self.step)
                if self.step % t.log_every == 0 or stop or self.batch_index == self.stream.steps_per_epoch:
                    _sync(env.device)
                    now = time.perf_counter()
                    self.train_time_s += now - tick
                    self.watchdog.at(self.step - 1, "logging all-reduce")
                    self._log_train(t_log, w_log, lr, bar)
                    t_log, w_log = self.train_time_s, self._log_words
                    tick = time.perf_counter()
                if stop:
                    break
                if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or (t.eval_every and self.step % t.eval_every == 0):
                    _sync(env.device)
                    self.train_time_s += time.perf_counter() - tick
                    if t.eval_every and self.step % t.eval_every == 0:
                        self.evaluate("valid")
                    if t.checkpoint_every and self.step % t.checkpoint_every == 0:
                        self.save()
                    tick = time.perf_counter()
        finally:
            source.close()
        return self.batch_index >= self.stream.steps_per_epoch

    def fit(self) -> dict[str, float]:
        """Train to the end (epochs or max_steps), validate every epoch, test at the end.

        Every rank must call it. Returns the summary numbers (perplexities, words/s, ...).
        """
        t0 = time.perf_counter()
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, desc=f"[rank 0] {self.cfg.dist.strategy}",
                       unit="step", dynamic_ncols=True, mininterval=1.0)
        try:
            while not self.strategy.finished(self.step, self.total_steps):
                ended = self._run_epoch(bar)
                if ended:
                    self.schedule.observe(self.evaluate("valid"))
                    self.epoch, self.batch_index = self.epoch + 1, 0
                    self.save()
                elif self.strategy.finished(self.step, self.total_steps):  # stopped inside an epoch
                    self.evaluate("valid")
                    self.save()
            if "valid_ppl" not in self.results:
                self.evaluate("valid")
            self.evaluate("test")
        except RuntimeError as e:  # a collective timed out or lost a peer: say who did not arrive
            if self.watchdog.store is None or not is_comm_failure(e):
                raise
            raise TrainingStopped(self.watchdog.diagnose(e)) from None
        finally:
            if bar is not None:
                bar.close()
        return self._finish(time.perf_counter() - t0)

    def _finish(self, wall_s: float) -> dict[str, float]:
        t, env = self.cfg.train, self.env
        words = self.strategy.words_trained(self.words, self.step) if self.log else 0
        summary = {
            "strategy": self.cfg.dist.strategy, "world_size": env.world_size, "global_batch": t.batch_size,
            "per_replica_batch": t.batch_size // self.strategy.num_replicas, "steps": self.step,
            "epochs": round(self.step / self.stream.steps_per_epoch, 3),
            "valid_ppl": self.results.get("valid_ppl", math.nan), "test_ppl": self.results.get("test_ppl", math.nan),
            "words_per_s": words / max(self.train_time_s, 1e-9),
            "words_per_s_after_warmup": (self._measured_words / self._measured_time_s
                                         if self._measured_time_s > 0 else math.nan),
            "wall_time_s": wall_s,
            "device": str(env.device), "backend": env.backend if env.world_size > 1 else "-",
            "threads_per_process": torch.get_num_threads(),
            "peak_memory_mb": round(peak_memory_bytes(env.device) / 2**20, 1),
        }
        timing = self.timer.summary()
        write_rank_timing(self.run_dir, self.env.rank, {
            "rank": self.env.rank, "world_size": self.env.world_size, "strategy": self.cfg.dist.strategy,
            "warmup_steps": self.cfg.train.timing_warmup_steps, **timing})
        summary.update({k: round(v, 3) for k, v in breakdown(timing).items()})
        summary["timed_steps"] = timing["measured_steps"]
        summary["nonfinite_steps"] = self.nonfinite_steps
        # wall time per measured step by the throughput clock (logging included): what the breakdown must add up to
        summary["train_step_ms"] = (1000.0 * self._measured_time_s / timing["measured_steps"]
                                    if timing["measured_steps"] and self.log else math.nan)
        if self.log:
            summary.update(self.strategy.metrics())
            self.log.write("summary", self.step, **summary)
        if self.log and self.verbose:
            rows = [("run dir", str(self.run_dir)), *summary.items()]
            print(format_summary(rows), flush=True)
        return summary

    def close(self, clean: bool = True) -> None:
        """Close metric files and release the strategy (every rank). ``clean=False`` after a
        failure: skip the strategy's teardown (its final barrier would wait for ranks that are gone)."""
        self.watchdog.close()
        if self.log:
            self.log.close()
            self.log = None
        if clean:
            self.strategy.teardown()
