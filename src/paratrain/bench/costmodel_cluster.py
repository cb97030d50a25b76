"""A cluster of machines for the cost model: ``intra`` links between the devices of one machine,
``inter`` NICs between machines (``paratrain plan --interconnect INTRA+INTER``). Pure arithmetic,
on :class:`~.costmodel.Link`. Sources: Patarasuk & Yuan 2009 (ring all-reduce); NCCL's rings, one per
NIC (rail-aligned), and nccl-tests' PERFORMANCE.md (bus bandwidth).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import UsageError
from .costmodel import PRESETS, Link, _check_n, pat_latency_s


CHANNELS_PER_NIC = 4
"""NCCL's channels (rings) a collective runs on, per NIC its ranks drive across machines: its search
finds a ring a NIC and doubles them on fast links (src/graph/search.cc, ncclTopoDupChannels), and
ncclTopoPostset doubles them again (src/graph/connect.cc): 32 on two DGX H100s. It sets where a ring
all-reduce's latency plateau starts (:func:`~.costmodel.allreduce_s`)."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Two levels of link: ``intra`` between the devices of one machine (node; NVLink, PCIe), ``inter``
    one network port (NIC) between machines (InfiniBand, Ethernet); ``devices_per_node`` devices and
    ``nics_per_node`` NICs to a machine. A job's ranks fill machines in order (torchrun's and Slurm's
    placement: ranks 0..g-1 on the first machine), so ``n`` ranks span ceil(n / g) machines.

    A collective over ranks on one machine uses ``intra``. Across machines, a ring all-reduce (and its
    halves, reduce-scatter and all-gather) runs as channels, one ring per NIC (NCCL's rail-aligned
    rings; Patarasuk & Yuan 2009 for one ring): each ring enters and leaves every machine once, through
    its own NIC, and takes 1 / K of the bytes. A ring's step is paced by its slowest hop, the NIC
    (``inter.beta``) or its share of the device's link (``intra.beta`` x K), so the whole costs
    2 (n-1)/n m max(beta_intra, beta_inter / K), the bus bandwidth of nccl-tests' PERFORMANCE.md
    bounded by the machine's K NICs. Its latency is NCCL's (src/graph/tuning.cc): of a ring's 2 (R-1)
    steps over R ranks on M machines, 2 (M-1) cross the network at inter's alpha, the rest stay
    inside a machine at intra's. NCCL also runs double binary trees between machines (Sanders, Speck &
    Traeff 2009), whose all-reduce latency over R ranks is 2 ((R/M - 1) alpha_intra + floor(log2 M) alpha_inter),
    at 0.45 of the bus bandwidth; it picks the faster per message (:func:`~.costmodel.allreduce_s`).
    A machine the job fills in part (n not a multiple of g) has d < g of its devices in the ring,
    which drive their share of its NICs (each device its own rail): K d / g of the least-filled
    machine, at least one. A pipeline of S stages all-reduces its S stage groups' replicas side by
    side: a machine holding min(S, its devices in the job) of the groups shares its NICs among them.
    A point-to-point send between machines (a pipeline's activations, a parameter server's messages,
    a tree broadcast's hop) goes through one NIC: ``inter`` itself.
    Across machines an all-reduce takes NCCL's corrections by message size of its Simple protocol
    (:func:`~.costmodel.allreduce_s`). Not modelled: SHARP (in-network reduction), NCCL's LL and LL128
    protocols."""

    intra: Link
    inter: Link
    devices_per_node: int
    nics_per_node: int

    def __post_init__(self) -> None:
        for key in ("devices_per_node", "nics_per_node"):
            _check_n(getattr(self, key), key)

    @property
    def name(self) -> str:
        return f"{self.intra.name}+{self.inter.name}"

    def nodes(self, n: int) -> int:
        """Machines that ``n`` ranks, placed in order, span: ceil(n / devices_per_node)."""
        _check_n(n)
        return -(-n // self.devices_per_node)

    def last(self, n: int) -> int:
        """Devices of the least-filled (last) machine in a job of ``n`` ranks: n - (nodes - 1) g."""
        return n - (self.nodes(n) - 1) * self.devices_per_node

    def nics(self, n: int) -> float:
        """NICs a ring over ``n`` ranks uses on each machine: the least-filled machine's share of its
        nics_per_node, K d / g with d = :meth:`last`, at least 1."""
        return max(1.0, self.nics_per_node * self.last(n) / self.devices_per_node)

    def spanned(self, n: int, stages: int = 1) -> int:
        """Machines a collective group of the job spans, the most of its groups: all ``n`` ranks' nodes(n);
        a pipeline's stage group s, ranks r S + s for its n / S replicas r (``stages`` = S). Raises
        UsageError where S does not divide n."""
        _check_n(stages, "stages")
        if n % stages:
            raise UsageError(f"{n} ranks do not make whole pipelines of {stages} stages; give N a multiple of S")
        if stages == 1:  # every rank in one group
            return self.nodes(n)
        g = self.devices_per_node
        return max(len({(r * stages + s) // g for r in range(n // stages)}) for s in range(stages))

    def collective_link(self, n: int, stages: int = 1) -> Link:
        """The link a collective over a job of ``n`` ranks is priced on: ``intra`` where the job is on
        one machine (n <= devices_per_node); else (the class doc), for a group of R = n / S ranks on
        M = :meth:`spanned` machines, alpha = NCCL's ring latency per step, ((R - M) alpha_intra +
        (M - 1) alpha_inter) / (R - 1), so that a ring all-reduce's 2 (R-1) steps (a reduce-scatter's or
        all-gather's R - 1) cost NCCL's sum exactly; beta = max(beta_intra, beta_inter x the busiest
        machine's groups per NIC); gamma = the devices' (``intra``'s); tree_latency_s = a double binary
        tree all-reduce's, 2 ((R // M - 1) alpha_intra + floor(log2 M) alpha_inter); channels = 4 a NIC
        of those one group drives, 4 max(1, ceil(1 / load)) (:data:`CHANNELS_PER_NIC`). ``stages``: a
        pipeline's S stage groups, each a collective over its replicas, side by side: a full machine
        holds min(S, g) of them on its K NICs, the least-filled one min(S, d) on :meth:`nics` (1 for any
        other layout: 1 / nics(n)). pat_latency_s: where every machine holds one rank of the group
        (:meth:`spanned` = R: NCCL's nNodes == nRanks, one device a machine, or a pipeline's stage group
        spread across machines), NCCL's PAT all-gather latency over the group's R ranks
        (:func:`~.costmodel_links.pat_latency_s`); None otherwise. base_latency_s: :attr:`base_latency_s`."""
        _check_n(stages, "stages")
        nodes = self.nodes(n)
        if nodes == 1:
            return self.intra
        load = max(min(stages, self.devices_per_node) / self.nics_per_node, min(stages, self.last(n)) / self.nics(n))
        ranks, machines = n // stages, self.spanned(n, stages)  # (spanned walks a pipeline's ranks: once)
        alpha, tree = self.latencies(ranks, machines)
        return Link(name=f"{self.name} ({nodes} nodes)", alpha_s=alpha,
                    beta_s_per_byte=max(self.intra.beta_s_per_byte, self.inter.beta_s_per_byte * load),
                    gamma_s_per_byte=self.intra.gamma_s_per_byte, tree_latency_s=tree,
                    channels=CHANNELS_PER_NIC * max(1, math.ceil(1 / load)),
                    pat_latency_s=(pat_latency_s(ranks, self.inter.alpha_s)
                                   if ranks > 1 and machines == ranks else None),
                    base_latency_s=self.base_latency_s)

    @property
    def base_latency_s(self) -> float:
        """A collective's base latency across machines (s): the larger of ``intra``'s and ``inter``'s
        (NCCL's is one per algorithm and protocol, :data:`~.costmodel_links.NCCL_BASE_LATENCY_S`)."""
        return max(self.intra.base_latency_s, self.inter.base_latency_s)

    def latencies(self, ranks: int, machines: int) -> tuple[float, float]:
        """NCCL's latencies (src/graph/tuning.cc) of a collective over ``ranks`` ranks on ``machines``
        machines (s): a ring step's mean alpha, ((R - M) alpha_intra + (M - 1) alpha_inter) / (R - 1)
        (alpha_inter for one rank, a guard: it has nothing to reduce), and a double binary tree
        all-reduce's, 2 ((R // M - 1) alpha_intra + floor(log2 M) alpha_inter)."""
        a_in, a_out = self.intra.alpha_s, self.inter.alpha_s
        alpha = ((ranks - machines) * a_in + (machines - 1) * a_out) / (ranks - 1) if ranks > 1 else a_out
        return alpha, 2 * ((ranks // machines - 1) * a_in + (machines.bit_length() - 1) * a_out)

    def p2p_link(self, across_nodes: bool) -> Link:
        """A point-to-point send's link: ``intra`` on one machine, else one NIC, ``inter``."""
        return self.inter if across_nodes else self.intra


NETWORK_PRESETS = frozenset({"ib400", "eth25"})
"""The presets that join machines. A flat one (``--interconnect ib400``) puts every device on it: a
cluster of machines of one device and one NIC each (:func:`flat_collective_link`); a flat ``nvlink``
or ``pcie5`` is one machine of any size."""


def flat_collective_link(link: Link, n: int, stages: int = 1) -> Link:
    """The link a collective over a job of ``n`` ranks is priced on for a flat preset ``link``: a
    network preset (:data:`NETWORK_PRESETS`) the same link with the trees and channels of machines of
    one device and one NIC (:meth:`Cluster.collective_link` of ``Cluster(link, link, 1, 1)``: a tree
    latency of 2 floor(log2 R) alpha over R = n / ``stages`` ranks, 4 channels, and NCCL's PAT latency
    for all-gathers over R > 1), where n > 1; the preset itself otherwise. Its alpha,
    beta and gamma are the preset's, exactly."""
    if link.name not in NETWORK_PRESETS or n == 1:
        return link
    across = Cluster(intra=link, inter=link, devices_per_node=1, nics_per_node=1).collective_link(n, stages)
    return replace(link, tree_latency_s=across.tree_latency_s, channels=across.channels,
                   pat_latency_s=across.pat_latency_s)


def flat_links(link: Link, n: int, stages: int = 1) -> tuple[Link, dict[str, Link]]:
    """A layout's links on a flat preset ``link``, as :func:`~.plan.cluster_links` gives a cluster's: the
    link of its collectives over ``n`` ranks (:func:`flat_collective_link`, a pipeline's over its n / S
    replicas) and the links placed apart: for a pipeline of ``stages`` = S > 1 on a network preset,
    ``"stages"``, its tied parameters' all-reduce over the S stages of a replica, on the trees of S
    one-device machines; none otherwise (every collective on the preset). ``paratrain plan`` and
    ``paratrain predict`` both price a flat preset by it."""
    placed = {"stages": flat_collective_link(link, stages)} if stages > 1 and link.name in NETWORK_PRESETS else {}
    return flat_collective_link(link, n, stages), placed


def cluster(name: str, devices_per_node: int, nics_per_node: int | None = None, *,
            machines: bool = True) -> Link | Cluster | None:
    """``--interconnect``'s preset: a flat :data:`PRESETS` link (``"ib400"``: every device on it),
    ``"INTRA+INTER"`` (``"nvlink+ib400"``) a :class:`Cluster` of ``devices_per_node`` devices and
    ``nics_per_node`` NICs per machine (None: one per device, as an HGX or DGX H100's eight), or None
    for ``"measured"`` (this machine's links, from the profile). The presets are taken as given (an
    INTER faster than INTRA too). ``machines=False`` (``paratrain predict``, which prices one link)
    takes a flat preset or ``"measured"`` only, and refuses an ``INTRA+INTER`` naming ``paratrain plan``.
    Raises UsageError naming the presets for an unknown name, ``nics_per_node`` on a flat or measured
    link, or ``nics_per_node`` < 1."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in PRESETS]
    forms = f"{', '.join(PRESETS)}, measured" + (", or INTRA+INTER of them (e.g. nvlink+ib400)" if machines else "")
    if name != "measured" and (len(parts) > 2 or unknown):
        what = (" is unknown" if unknown == [name] else ": measured is this machine's links, alone"
                if "measured" in parts else ": INTRA+INTER needs two link names" if "" in parts
                else f": {', '.join(map(repr, unknown))} unknown" if unknown else ": give at most two links")
        raise UsageError(f"--interconnect {name!r}{what}; use one of {forms}")
    if len(parts) == 2 and not machines:  # a well-formed INTRA+INTER where one link is priced
        raise UsageError(f"--interconnect {name!r}: a cluster of machines (INTRA+INTER) is priced by paratrain "
                         f"plan CONFIG --interconnect {name}; paratrain predict takes one link: use one of {forms}")
    if len(parts) == 1:
        if nics_per_node is not None:
            raise UsageError(f"--nics-per-node {nics_per_node}: NICs price the network between machines; give a "
                             f"two-level --interconnect INTRA+INTER (e.g. nvlink+ib400) or leave it out")
        return None if name == "measured" else PRESETS[name]
    if nics_per_node is not None and nics_per_node < 1:
        raise UsageError(f"--nics-per-node {nics_per_node}: give the network ports of one machine, >= 1")
    return Cluster(intra=PRESETS[parts[0]], inter=PRESETS[parts[1]], devices_per_node=devices_per_node,
                   nics_per_node=devices_per_node if nics_per_node is None else nics_per_node)
