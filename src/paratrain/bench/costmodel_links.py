"""Links and collectives of the cost model: Hockney's alpha-beta(-gamma) :class:`Link`, the
interconnect :data:`PRESETS`, and the seconds of a ring all-reduce (Patarasuk & Yuan 2009), of the
all-reduce NCCL picks where ranks span machines (:func:`allreduce_s`: its double binary trees and its
corrections by message size, NCCL src/graph/tuning.cc) and of binomial trees (Thakur, Rabenseifner &
Gropp 2005). Pure arithmetic; :mod:`.costmodel` re-exports every name here. Units: seconds, bytes.
Bad arguments raise :class:`~paratrain.errors.UsageError` naming the value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link in Hockney's alpha-beta model plus a reduction cost.

    alpha_s: latency per message (s); beta_s_per_byte: inverse bandwidth per
    direction (s/byte); gamma_s_per_byte: local reduction of one byte (s/byte).
    tree_latency_s: where the collective spans machines and NCCL also runs its double binary trees
    between them (:meth:`~.costmodel_cluster.Cluster.collective_link`), a tree all-reduce's latency
    (s), for :func:`allreduce_s`; None (one machine, or a link with no machines): rings only, and none
    of NCCL's corrections across machines. ``channels``: with it, NCCL's rings (channels) the
    collective runs on, for the ring's latency plateau in :func:`allreduce_s` (an integer >= 1).
    A cluster's collective link holds for the group it was made for (R ranks on M machines): its
    alpha_s is a ring step's mean latency there, its tree_latency_s that group's tree's; price
    collectives of R ranks on it, and not one message as alpha_s. ``pat_latency_s``: where every
    machine holds one rank of the collective (a flat network preset; one device a machine; a
    pipeline's stage group spread across machines), the latency of NCCL's PAT all-gather (and
    reduce-scatter of a plain sum) over them (:data:`PAT_PER_RANK_S`), for
    :func:`~.costmodel_sharded.allgather_s`; None: rings only. ``base_latency_s``: NCCL's base latency of
    one collective (s), paid once on top of its steps' (:data:`NCCL_BASE_LATENCY_S` on the presets and the
    links made from them); 0 on a measured link, whose fitted alpha holds whatever a collective pays once.
    """

    name: str
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    tree_latency_s: float | None = None
    channels: int | None = None
    pat_latency_s: float | None = None
    base_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if (self.tree_latency_s is None) != (self.channels is None) or (self.channels is not None and not (
                isinstance(self.channels, (int, np.integer)) and not isinstance(self.channels, bool)
                and self.channels >= 1)):
            raise UsageError(f"Link {self.name!r}: a link across machines gives tree_latency_s and channels (an "
                             f"integer >= 1) together, got {self.tree_latency_s} and {self.channels}")
        for key, value in self.terms().items():  # (tree_latency_s and channels where set)
            if not (value >= 0 and math.isfinite(value)):
                raise UsageError(f"Link {self.name!r}: {key} = {value} must be finite and >= 0")

    def terms(self) -> dict[str, float]:
        """{alpha_s, beta_s_per_byte, gamma_s_per_byte} (and tree_latency_s, channels, pat_latency_s where
        set, base_latency_s where not 0), as profiles and plans store a link: ``Link(name=..., **terms)`` is
        the link again."""
        terms = {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                 "gamma_s_per_byte": self.gamma_s_per_byte}
        if self.tree_latency_s is not None:
            terms.update(tree_latency_s=self.tree_latency_s, channels=self.channels)
        if self.pat_latency_s is not None:
            terms.update(pat_latency_s=self.pat_latency_s)
        return terms if not self.base_latency_s else {**terms, "base_latency_s": self.base_latency_s}


# GPU-side reduction: an fp32 add reads two bytes and writes one per byte reduced; at the H100
# SXM's 3.35 TB/s HBM3 bandwidth (NVIDIA H100 datasheet) that is 3 / 3.35e12 s per byte.
_GPU_GAMMA = 3 / 3.35e12
# The alphas of nvlink, pcie5 and ib400 are NCCL's own per-step latencies for its Simple protocol, the one
# that carries gradient buckets (src/graph/tuning.cc, ncclTunerConstantsDefaults hwLatencies: a ring step
# 3.4 us on NVLink, 5.7 us on PCIe, 14 us across the network; a tree level 4.0, 4.0 and 14 us, priced here
# at the ring's), and each collective's base latency once (baseLatencies: 8.4 us for a ring's or a tree's
# Simple protocol, NCCL_BASE_LATENCY_S; PAT's 8.0, PAT_BASE_LATENCY_S). Not modelled: its LL and LL128
# protocols, which carry small messages at lower latency. eth25's alpha is an assumption.
# Fit your own link with fit_alpha_beta / microbench.measured_link.
NCCL_BASE_LATENCY_S = 8.4e-6
PRESETS: dict[str, Link] = {
    # NVLink 4 on H100 SXM: 900 GB/s bidirectional = 450 GB/s per direction (NVIDIA datasheet).
    "nvlink": Link(name="nvlink", alpha_s=3.4e-6, beta_s_per_byte=1 / 450e9, gamma_s_per_byte=_GPU_GAMMA,
                   base_latency_s=NCCL_BASE_LATENCY_S),
    # PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b ~ 64 GB/s per direction.
    "pcie5": Link(name="pcie5", alpha_s=5.7e-6, beta_s_per_byte=1 / 64e9, gamma_s_per_byte=_GPU_GAMMA,
                   base_latency_s=NCCL_BASE_LATENCY_S),
    # NDR InfiniBand 400 Gb/s = 50 GB/s per direction; alpha: NCCL's network step (its proxy included).
    "ib400": Link(name="ib400", alpha_s=14e-6, beta_s_per_byte=1 / 50e9, gamma_s_per_byte=_GPU_GAMMA,
                   base_latency_s=NCCL_BASE_LATENCY_S),
    # 25 GbE = 3.125 GB/s per direction; alpha of a TCP message through the kernel stack, an assumption
    # (NCCL's tuner gives any network 14 us a step, and every one the same base latency of a collective; a TCP
    # message through the kernel takes longer).
    "eth25": Link(name="eth25", alpha_s=40e-6, beta_s_per_byte=1 / 3.125e9, gamma_s_per_byte=_GPU_GAMMA,
                   base_latency_s=NCCL_BASE_LATENCY_S),
}


def base_s(n: int, link: Link) -> float:
    """The base latency a collective among ``n`` ranks pays on ``link`` once: ``link.base_latency_s``
    for n > 1, 0 for n == 1 (no collective runs)."""
    return link.base_latency_s if n > 1 else 0.0


def base_latency_words(terms: dict) -> str:
    """A header's words after a link's alpha for its base latency of a collective (NCCL's, on a preset:
    :attr:`Link.base_latency_s`); nothing for a measured link (none). ``terms``: :meth:`Link.terms`'s dict."""
    base = terms.get("base_latency_s", 0.0)
    return f" a step + {base * 1e6:.1f} us a collective" if base else ""


def _check_n(n: int, what: str = "n") -> None:
    if not (isinstance(n, (int, np.integer)) and n >= 1):
        raise UsageError(f"{what} = {n!r} must be an integer >= 1")


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``: 2(n-1)/n * nbytes."""
    _check_n(n)
    return 2 * (n - 1) / n * nbytes


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce (Patarasuk & Yuan 2009):
    base + 2(n-1) alpha + 2(n-1)/n nbytes beta + (n-1)/n nbytes gamma (base: ``link.base_latency_s``,
    NCCL's once a collective); 0 for n == 1."""
    _check_n(n)
    if n == 1:
        return 0.0
    return (base_s(n, link) + 2 * (n - 1) * link.alpha_s + ring_allreduce_bytes(nbytes, n) * link.beta_s_per_byte
            + (n - 1) / n * nbytes * link.gamma_s_per_byte)


# NCCL's tuning model (src/graph/tuning.cc, ncclTopoTuneModel): a tree all-reduce's algorithm bandwidth
# is half its bus bandwidth (every byte goes up the tree and back down), and the bus bandwidth a tree
# reaches is 0.9 of the ring's
TREE_ALGORITHM_BANDWIDTH = 0.5 * 0.9

# NCCL's corrections by message size (src/graph/tuning.cc, ncclTopoGetAlgoTime; NCCL 2.30), for its
# Simple protocol, the one that carries large messages: "trees are not perfectly sticking to the model
# for medium sizes", so a tree all-reduce's bandwidth is scaled by the factor of floor(log2(nbytes / 64)),
# 64 B to 512 MiB (1 outside) ...
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)
# ... and a ring all-reduce across machines of at least 64 bytes a channel a rank waits this many times
# its latency ("plateau effect of ring": 1.4 on compute capability 8.0 and above, the presets' A100/H100
# era; 1.9 before)
RING_PLATEAU = 1.4


# NCCL's PAT algorithm (Parallel Aggregated Trees; src/graph/tuning.cc, NCCL 2.30) for all-gather and
# reduce-scatter, which it runs only where every machine holds one rank of the communicator: a latency of
# log2i(M) levels of the network at 1 / 3.5 of its tree latency each, plus 2.8 us a rank ("still a linear
# part"), at 0.75 of the ring's bus bandwidth, on the whole message (no (R - 1) / R); NCCL takes the faster
# of it and the ring per message
PAT_PER_RANK_S = 2.8e-6
PAT_BASE_LATENCY_S = 8.0e-6
PAT_LEVEL_FRACTION = 1 / 3.5
PAT_BANDWIDTH = 0.75


def pat_latency_s(ranks: int, alpha_s: float) -> float:
    """NCCL's PAT latency over ``ranks`` ranks, one a machine, on a network of per-step latency
    ``alpha_s`` (s): its base latency (:data:`PAT_BASE_LATENCY_S`, 8.0 us) + floor(log2 R) alpha / 3.5
    + 2.8 us x R."""
    _check_n(ranks, "ranks")
    return PAT_BASE_LATENCY_S + (ranks.bit_length() - 1) * alpha_s * PAT_LEVEL_FRACTION + PAT_PER_RANK_S * ranks


def tree_correction(nbytes: float) -> float:
    """NCCL's factor on a tree all-reduce's bandwidth for ``nbytes`` (:data:`TREE_CORRECTION`; 1 below
    64 bytes and from 512 MiB)."""
    index = (int(nbytes) >> 6).bit_length() - 1  # NCCL's log2i(nBytes >> 6); -1 below 64 bytes
    return TREE_CORRECTION[index] if 0 <= index < len(TREE_CORRECTION) else 1.0


def allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of the all-reduce NCCL runs on ``link`` among ``n`` ranks: the ring
    (:func:`ring_allreduce_s`); where the ranks span machines (``link.tree_latency_s`` set: a cluster's
    collective link across machines, or a flat network preset's, one device a machine;
    :meth:`~.costmodel_cluster.Cluster.collective_link`), the faster of the ring and NCCL's double binary
    trees, as NCCL's tuner picks per message (NCCL src/graph/tuning.cc; Sanders, Speck & Traeff 2009):

    * tree: base + tree_latency_s + nbytes beta / (0.45 c) + nbytes gamma (each rank reduces its two children's
      halves), c = :func:`tree_correction` (nbytes);
    * ring: :func:`ring_allreduce_s` with its latency 2 (n-1) alpha x :data:`RING_PLATEAU` where
      nbytes >= 64 x channels x n;

    base: ``link.base_latency_s``, NCCL's once a collective, in both.

    Both corrections are NCCL's for its Simple protocol; its LL and LL128 protocols, which carry small
    messages at lower latency and bandwidth, are not modelled. 0 for n == 1."""
    ring = ring_allreduce_s(nbytes, n, link)
    if link.tree_latency_s is None or n == 1:
        return ring
    if nbytes >= 64 * link.channels * n:
        ring += (RING_PLATEAU - 1) * 2 * (n - 1) * link.alpha_s
    tree = (base_s(n, link) + link.tree_latency_s
            + nbytes * link.beta_s_per_byte / (TREE_ALGORITHM_BANDWIDTH * tree_correction(nbytes))
            + nbytes * link.gamma_s_per_byte)
    return min(ring, tree)


def tree_broadcast_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a binomial-tree broadcast from one rank, whole message per step (Thakur et al.
    2005, section 4.2): base + ceil(log2 n) (alpha + nbytes beta), base = ``link.base_latency_s`` (NCCL's
    once a collective); 0 for n == 1."""
    _check_n(n)
    return base_s(n, link) + math.ceil(math.log2(n)) * (link.alpha_s + nbytes * link.beta_s_per_byte)


def tree_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a binomial-tree reduce to rank 0 followed by a binomial-tree broadcast, whole
    message per step, no pipelining (Thakur et al. 2005, sections 4.2/4.3):
    base + 2 ceil(log2 n) (alpha + nbytes beta) + ceil(log2 n) nbytes gamma, base = ``link.base_latency_s``
    (once a collective); 0 for n == 1."""
    _check_n(n)
    depth = math.ceil(math.log2(n))
    return (base_s(n, link) + 2 * depth * (link.alpha_s + nbytes * link.beta_s_per_byte)
            + depth * nbytes * link.gamma_s_per_byte)
