"""The profile's cache for ``paratrain plan`` (:mod:`.profile`): ``DIR/profile.json`` with a key of
everything the measurement depends on, so re-planning for another cluster reads it instead of
measuring again; the profile's version, its history, and which older versions a profile measured
elsewhere may still have (:func:`compatible`, ``paratrain plan --profile``)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

PROFILE_VERSION = 44  # (since 2026-12-01 a CPU's profile of 44 may hold loop_towers, the towers' step in the
# training loop, and its one-device runs' host memory: optional keys, without which the plan prices as before)
# 44: a CPU's sync BatchNorm between processes (loop_sync_batchnorm_s, sync_batchnorm_s)
# with its backward in one function (strategies.sync_batchnorm.GroupBatchNorm: 3 all-reduces a layer, was 4);
# 43: what each pipeline stage's forward saves for a micro-batch (stage_saved_bytes, the
# plan's split of the activations over the stages; was their compute's split), and the part of the
# one-device activations that is the data set's storage the batch views (data_bytes: a language model's
# corpus shard; any device, any precision);
# 42: what checkpointing every block costs the step ("checkpointing": the model and
# a checkpointed copy timed in paired rounds, in process; any device, any precision);
# 41: a bf16 or fp16 recipe's autocast casts of the weights apart from the activations
# (autocast_copy_bytes; were counted in activation_bytes, which the plan scales with the batch per replica),
# its fsdp units' gather_scale, and a CPU's fsdp_units timed under FSDP2's MixedPrecisionPolicy (any device);
# 40: a bf16 or fp16 recipe's in-process steps, blocks, FLOPs and memory under its
# autocast, as training runs its forward (was: in the stored dtype; any device);
# 39: a CPU's fsdp_units, zero1_step_s and fsdp_step_s timed with the recipe's model's
# forward and backward (a rank's batch) before each pass or step, as in training (was: nothing between them);
# 38: a CPU's default-thread one-device step the median of rounds spread over the
# profile (its first rounds, then one after the one-rank runs and one after the last of the loop's runs);
# 37: a CPU's fsdp_units timed on units of their own parameters' shapes and dtypes
# (was: one float32 tensor of the unit's bytes);
# 36: a CPU's towers_forward_threads has the towers' backward too ("backward_seconds")
# and, for a recipe with sync BatchNorm, "sync_batchnorm_s" (the towers plain and synchronised in turn, in one
# process), medians over about 2 s of timed steps in all (was: the forward alone, 5 times); the loop then runs
# sync BatchNorm's on/off pair for the processes only;
# 35: measured with one malloc arena and a heap never trimmed (dist.cpu_allocator's
# retain: a CPU tower's thread and the intra-op workers allocate from the main heap, their blocks above 64 MiB
# no longer mapped per step, nor a step's frees above 2 GiB);
# 34: measured under dist.cpu_allocator (devices.apply_cpu_allocator: glibc keeps freed
# blocks, 20-38% off a CPU's step of the LSTM and GPT recipes), in the profile's own process and every one it starts;
# 33: a CPU's loop_ps_stolen_s and loop_ps_guard_s (ps-sync's and ps-async's jobs in the
# loop: their workers' compute beyond side by side, and their norm and clip around the exchange);
# 32: pipeline stage profiles on the recipe's device (a GPU's were timed on its host CPU) and under its
# precision's autocast (as the pipeline runs them);
# 31: a CPU's pipeline stage profiles at a stage process' threads, their
# microbatch_factor the median of paired rounds (was: 3 whole passes, then 3 split ones);
# 30: skipped (a reverted commit, 6f863a7, measured CPU profiles as 30: they must not read as 31's);
# 29: a CPU's loop_ps_async_stolen_s (an async PS worker's compute in the loop);
# 28: the loaded exchange's stretches calibrated after the workers' start line
# (the best of 5 windows) and timed alone and among exchanges in turn, twice;
# 27: a CPU's ps_round_trips_loaded(_4) "stolen", an async worker's compute among
# exchanges (its stretches are fixed work, were seconds by the clock);
# 26: a CPU's towers_forward_threads is CPUTowers' forward with its join and loss
# ("joined"; was: the towers' forwards alone, each with its own loss);
# 25: a CPU's bf16_hook (DDP's bf16 compression hook between 2 ranks);
# 24: a CPU's ps_round_trips_loaded_4 (the same exchange among 4 workers);
# 23: a CPU's ps_round_trips_loaded (an async PS exchange among computing workers)
# and fsdp_step_s (FSDP2's optimizer step between 2 ranks); 22: a CPU's loop_one_rank_s too (for presets);
# 21: loop_buffer_broadcast_s, DDP's buffer broadcast in the loop (CPU, BatchNorm);
# 20: the loop's sync BatchNorm key-off runs of DDP without its buffer broadcast;
# 19: a GPU's loop_one_rank_s, each strategy's own work at one rank;
# 18: zero1_step_s, what ZeRO-1's optimizer step adds to allreduce's between 2 ranks;
# 17: fsdp_units are all FSDP2 adds to a unit between 2 ranks (was: beyond one rank
# with FSDP2); 16: loop_sync_batchnorm_oversubscribed counts "processes" as meetings_oversubscribed
# does (was "replicas"); 15: the loop's sync BatchNorm at the recipe's batch per replica (was half);
# 14: on fewer than 4 cores, sync BatchNorm in the loop and the meetings at 4 processes
# (oversubscribed); the layers' sync BatchNorm micro-benchmarks only for what the loop did not measure;
# 13: sync BatchNorm's meetings timed after the step's compute per layer; 12: a parameter
# server's round trip (the PS's link); 11: the step's spread from
# successive differences (timing.successive_difference_sd), without the run's drift; 10: FSDP2's collectives
# per unit, a collective's wait inside a step; 9: the one-device step's spread (straggle_s), the DTensor
# optimizer's dispatch; 8: CPU towers' forwards in threads; 7: the PS servers' update; 6: CPU towers' sync
# BatchNorm; 5: memory copies, the RPC link to 64 MiB; 4: RPC over uv
DEVICE_ONLY_CHANGES = {**{v: "cpu" for v in range(20, 32)}, **{v: "cpu" for v in range(33, 40)}, 44: "cpu"}
"""Profile versions whose change touched the profiles of one device type only (20: the loop's sync
BatchNorm runs; 21: the loop's runs of DDP's buffer broadcast; a CPU alone makes both; 22: a CPU's
one-rank runs, which a GPU's profile had since 19; 23: a CPU's loaded PS exchange and FSDP2 step; 24:
a CPU's loaded PS exchange among 4 workers; 25: a CPU's bf16 hook; 26: a CPU's towers' forward; 27,
28: a CPU's loaded PS compute; 29: a CPU's async PS compute in the loop; 30: skipped, a reverted
commit's CPU profiles; 31: a CPU's stage profiles at a stage process' threads; a GPU's, timed on its
host, keep their threads and measure the same ratio, paired by round; 33: a CPU's PS workers' guard in
the loop; 34: the host's allocator, which moves a CPU's step; a GPU's kernels do not use it, though its
host-side work (a parameter server's CPU tensors) does; 35: the same allocator's one arena, likewise; 36:
a CPU's towers' backward and their sync BatchNorm measured in one process; 37: a CPU's FSDP2 units of
their own parameters; 38: a CPU's one-device step over rounds spread across the profile; 39: a CPU's FSDP2
units and sharded steps after the model's compute; 44: a CPU's sync BatchNorm between processes, whose
backward is one function since; a GPU's profile does not time it):
a profile of an older version and another device type holds the same measurements as one of
:data:`PROFILE_VERSION` (:func:`compatible`). 32 is not among them: it moved a GPU's stage profiles onto
the GPU, and a CPU's of a bf16 or fp16 recipe under autocast."""

MIXED_PRECISION_ONLY_CHANGES = frozenset({40, 41})
"""Profile versions whose change touched the profiles of bf16 and fp16 recipes only (``train.precision``;
40: their whole-model profile under autocast, on every device; 41: their autocast casts apart, their
FSDP2 units under its mixed-precision policy): an fp32 recipe's profile of an older version holds the same
measurements (:func:`compatible`). (An fp32 profile of an older version has no ``gather_scale`` nor
``autocast_copy_bytes``: the plan reads them as 1 and 0, which they are in fp32.)"""


SKIPPED_VERSIONS = frozenset({30})
"""Versions no released paratrain measures: 30 was a reverted commit's (6f863a7, its meetings'
calibration, which a GPU's profile uses too). A profile of one is read on no device."""


def compatible(version: int | None, device: str, precision: str = "fp32") -> bool:
    """Whether a profile of ``version`` measured on ``device`` (e.g. ``"cuda:0"``) for a recipe of
    ``train.precision`` ``precision`` holds what :data:`PROFILE_VERSION` measures there: the same
    version, or an older one where every version since changed another device type's profiles only
    (:data:`DEVICE_ONLY_CHANGES`) or, for fp32, mixed-precision recipes' only
    (:data:`MIXED_PRECISION_ONLY_CHANGES`); never one of :data:`SKIPPED_VERSIONS`."""
    if not isinstance(version, int) or version > PROFILE_VERSION or version in SKIPPED_VERSIONS:
        return False
    kind = str(device).split(":")[0]

    def applies(v: int) -> bool:
        return (DEVICE_ONLY_CHANGES.get(v, kind) == kind
                and (precision != "fp32" or v not in MIXED_PRECISION_ONLY_CHANGES))
    return not any(applies(v) for v in range(version + 1, PROFILE_VERSION + 1))


def profile_key(config_text: str, cores: int) -> str:
    """What a cached profile depends on: the recipe after overrides, versions, cores."""
    import platform

    from .. import __version__

    text = json.dumps([PROFILE_VERSION, config_text, torch.__version__, __version__, cores, platform.node()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_profile(path: Path, key: str, measure: Callable[[], dict], fresh: bool = False) -> tuple[dict, bool]:
    """(profile, True if read from ``path``): the cached one when its key matches and not ``fresh``
    (``--reprofile``), else measured now and written (atomically): the file there is replaced only by a
    whole new profile, so an interrupted measurement leaves the last one in place; the phases
    ``measure`` kept in :data:`PARTIAL` beside it (:class:`PartialProfile`) are removed once it is written."""
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key and not fresh:
            return cached, True
    except (OSError, ValueError):
        pass
    prof = {**measure(), "key": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    from ..interrupts import signals_held

    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(prof, indent=1))
    with signals_held():  # an interrupt between the two would leave a finished partial beside its profile
        tmp.replace(path)
        path.with_name(PARTIAL).unlink(missing_ok=True)  # its phases are in the whole profile now
    return prof, False


PARTIAL = "profile.partial.json"
"""The file beside ``profile.json`` that holds a profile's phases measured so far (:class:`PartialProfile`)."""


class PartialProfile:
    """``DIR/profile.partial.json``: the phases of a profile measured so far, written (atomically) after
    each one, so that a profile cut short (Ctrl-C, SIGTERM, a job's or a lease's time limit) resumes
    where it stopped: the next measurement of the same key (:func:`profile_key`: the recipe, the
    versions, the cores, the host) and the same ``settings`` (what else the measurement depends on:
    the profile's options, the environment that picks the device and threads; JSON-able) reads the
    phases done and measures only the rest. A file of another key or other settings is ignored (and
    replaced at the first phase; :attr:`other_settings` holds its settings where only they differ).
    :func:`cached_profile` removes it once the whole profile is written.

    ``profile``: the profile's keys so far; ``extra``: what later phases need beyond them (JSON-able,
    e.g. the one-device rounds); ``done``: the phases' names in the order they were measured;
    ``sittings``: when each sitting began (``%Y-%m-%d %H:%M``), the first the profile's own."""

    def __init__(self, path: Path, key: str, settings: dict | None = None):
        import datetime

        self.path, self.key = path, key
        self.settings: dict = json.loads(json.dumps(settings or {}))  # as the file holds them
        self.other_settings: dict | None = None
        state: dict = {}
        try:
            got = json.loads(path.read_text())
            if isinstance(got, dict) and got.get("key") == key:
                if (got.get("settings") or {}) == self.settings:
                    state = got
                elif got.get("done"):
                    self.other_settings = got.get("settings") or {}
        except (OSError, ValueError):
            pass
        self.profile: dict = dict(state.get("profile") or {})
        self.extra: dict = dict(state.get("extra") or {})
        self.done: list[str] = list(state.get("done") or [])
        earlier = (state.get("sittings") or []) if self.done else []
        self.sittings: list[str] = [*earlier, f"{datetime.datetime.now():%Y-%m-%d %H:%M}"]

    @property
    def resumed(self) -> bool:
        """Whether this sitting resumes phases measured in an earlier one."""
        return len(self.sittings) > 1

    def phase(self, name: str, measure: Callable[[], None]) -> bool:
        """Run ``measure()`` (which updates :attr:`profile` and :attr:`extra`) unless phase ``name`` is
        done, then record it done and write the file. Returns whether it ran. An exception in
        ``measure`` propagates and leaves the file as it was after the last phase."""
        if name in self.done:
            return False
        measure()
        self.done.append(name)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"key": self.key, "settings": self.settings, "done": self.done,
                                   "sittings": self.sittings, "profile": self.profile, "extra": self.extra}, indent=1))
        tmp.replace(self.path)
        return True
