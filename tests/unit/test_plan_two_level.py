"""A two-level cluster (``--interconnect INTRA+INTER``): the link each collective is priced on, by
hand, and its properties: more NICs never predict a slower step, and a cluster's step lies between
its intra-node link's alone and its network's alone.

The made-up links use powers of two so that the hand-computed times are exact in floating point."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.bench.costmodel import PRESETS, Link, ring_allreduce_s
from paratrain.bench.costmodel_cluster import Cluster, cluster, flat_collective_link, flat_links
from paratrain.bench.costmodel_pipeline import predict_pipeline
from paratrain.bench.plan import cluster_links
from paratrain.bench.plan_model import Layout, step_parts
from paratrain.config import Config
from paratrain.errors import UsageError

from .test_plan_model import INPUTS, LAYOUTS, W

FAST = Link(name="fast", alpha_s=1.0, beta_s_per_byte=0.125, gamma_s_per_byte=0.25)
WIRE = Link(name="wire", alpha_s=2.0, beta_s_per_byte=1.0, gamma_s_per_byte=0.5)


def _cluster(per_node: int = 4, nics: int = 4) -> Cluster:
    return Cluster(intra=FAST, inter=WIRE, devices_per_node=per_node, nics_per_node=nics)


@pytest.mark.parametrize("n, nodes", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_ranks_fill_machines_in_order(n, nodes):
    assert _cluster().nodes(n) == nodes


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_collective_on_one_machine_is_priced_on_the_intra_node_link(n):
    assert _cluster().collective_link(n) == FAST
    assert ring_allreduce_s(8, n, _cluster().collective_link(n)) == ring_allreduce_s(8, n, FAST)


@pytest.mark.parametrize("nics, stages, beta", [
    (4, 1, 0.25),    # 4 rings, one per NIC: each NIC carries a quarter of the bytes, max(0.125, 1 / 4)
    (1, 1, 1.0),     # one NIC carries everything: the network's own beta
    (16, 1, 0.125),  # more NICs than the device's link can feed: the device's link paces the ring
    (4, 2, 0.5),     # a pipeline's two stage groups side by side share the 4 NICs: 2 each, 1 / 2
])
def test_a_collective_across_machines_runs_one_ring_per_nic_by_hand(nics, stages, beta):
    link = _cluster(nics=nics).collective_link(8, stages=stages)
    assert (link.beta_s_per_byte, link.gamma_s_per_byte) == (beta, 0.25)
    assert link.name == "fast+wire (2 nodes)"
    # R = 8 / S ranks, 8 bytes: 2 steps, 2 of them across the 2 machines at the wire's alpha 2, the rest
    # at the machine's 1; + 2 (R-1)/R m beta + (R-1)/R m gamma
    r = 8 // stages
    assert ring_allreduce_s(8, r, link) == pytest.approx(
        2 * ((r - 2) * 1.0 + 1 * 2.0) + 2 * (r - 1) / r * 8 * beta + (r - 1) / r * 8 * 0.25, rel=1e-12)


@pytest.mark.parametrize("n, stages, machines, ring, tree", [
    (8, 1, 2, 2 * (6 * 1.0 + 1 * 2.0), 2 * (3 * 1.0 + 1 * 2.0)),      # 2 machines of 4
    (12, 1, 3, 2 * (9 * 1.0 + 2 * 2.0), 2 * (3 * 1.0 + 1 * 2.0)),     # 3 machines: floor(log2 3) = 1 level
    (32, 1, 8, 2 * (24 * 1.0 + 7 * 2.0), 2 * (3 * 1.0 + 3 * 2.0)),    # 8 machines: 3 levels
    (16, 2, 4, 2 * (4 * 1.0 + 3 * 2.0), 2 * (1 * 1.0 + 2 * 2.0)),     # stage 0: ranks 0, 2, .., 14 on 4 machines
    (12, 3, 3, 2 * (1 * 1.0 + 2 * 2.0), 2 * (0 * 1.0 + 1 * 2.0)),     # stage 0: ranks 0, 3, 6, 9 on 3 machines
    (16, 8, 2, 2 * (0 * 1.0 + 1 * 2.0), 2 * (0 * 1.0 + 1 * 2.0)),     # stage s: ranks s, 8 + s, one a machine
])
def test_a_collectives_latency_crosses_the_network_only_between_machines_by_hand(n, stages, machines, ring, tree):
    """NCCL's tuning model (src/graph/tuning.cc): a ring all-reduce over R ranks on M machines waits
    2 (M-1) times for the network and 2 (R-M) times for the machine's link; a reduce-scatter or
    all-gather half that; a double binary tree 2 ((R/M - 1) alpha_intra + floor(log2 M) alpha_inter)."""
    from paratrain.bench.costmodel_sharded import ring_allgather_s, ring_reduce_scatter_s

    c = _cluster()  # machines of 4; FAST alpha 1, WIRE alpha 2
    link = c.collective_link(n, stages=stages)
    r = n // stages
    assert c.spanned(n, stages) == machines
    assert ring_allreduce_s(0, r, link) == pytest.approx(ring, rel=1e-12)
    assert ring_reduce_scatter_s(0, r, link) == ring_allgather_s(0, r, link) == pytest.approx(ring / 2, rel=1e-12)
    assert link.tree_latency_s == tree


@given(n=st.integers(1, 200), g=st.integers(1, 16), stages=st.sampled_from([1, 2, 4]))
def test_the_machines_a_group_spans_are_those_its_ranks_sit_on(n, g, stages):
    """:meth:`Cluster.spanned` against the placement itself: rank i on machine i // g, stage group s the
    ranks r S + s (at S = 1 every rank, answered without the walk)."""
    c = Cluster(intra=FAST, inter=WIRE, devices_per_node=g, nics_per_node=1)
    n *= stages
    assert c.spanned(n, stages) == max(len({i // g for i in range(s, n, stages)}) for s in range(stages))


def test_a_pipelines_stage_groups_are_priced_on_the_group_that_spans_the_most_machines():
    # machines of 6, 4 stages, 2 replicas (ranks 0-3 and 4-7): stages 0 and 1 (ranks 0, 4 and 1, 5) stay on
    # machine 0, stages 2 and 3 (ranks 2, 6 and 3, 7) span machines 0 and 1
    c = Cluster(intra=FAST, inter=WIRE, devices_per_node=6, nics_per_node=6)
    link = c.collective_link(8, stages=4)
    assert c.spanned(8, 4) == 2
    assert ring_allreduce_s(0, 2, link) == 2 * (0 * 1.0 + 1 * 2.0)  # both steps on the network
    assert link.tree_latency_s == 2 * (0 * 1.0 + 1 * 2.0)
    with pytest.raises(UsageError, match="8 ranks do not make whole pipelines of 3 stages"):
        c.spanned(8, 3)


def test_nccl_runs_the_tree_where_it_is_faster_and_the_ring_where_it_is():
    from paratrain.bench.costmodel import allreduce_s

    link = _cluster().collective_link(16)  # 4 machines of 4, 4 NICs: beta max(0.125, 1 / 4), 16 channels
    assert (link.beta_s_per_byte, link.channels) == (0.25, 16)
    # a small message: the tree's latency 2 (3 x 1 + 2 x 2) = 14 against the ring's 2 (12 x 1 + 3 x 2) = 36
    assert ring_allreduce_s(0, 16, link) == pytest.approx(36.0, rel=1e-12)
    assert allreduce_s(0, 16, link) == 14.0
    # 64 bytes: the tree 14 + 64 x 0.25 / (0.45 x 0.9) + 64 x 0.25 = 69.5 (NCCL's 0.9 at 64 B) against the
    # ring 36 + 30 + 15 = 81
    assert allreduce_s(64, 16, link) == pytest.approx(14 + 64 * 0.25 / (0.45 * 0.9) + 64 * 0.25, rel=1e-12)
    # 4096 bytes: the ring 36 + 2 x 15/16 x 4096 x 0.25 + 15/16 x 4096 x 0.25 = 2916, below the tree's
    # 14 + 4096 x 0.25 / (0.45 x 0.9) + 1024 = 3566.3; 4096 < 64 B x 16 channels x 16 ranks: no plateau
    assert allreduce_s(4096, 16, link) == ring_allreduce_s(4096, 16, link) == pytest.approx(2916.0, rel=1e-12)
    # from 16 KiB (64 bytes a channel a rank) the ring waits 1.4 x its latency: 50.4 + 7680 + 3840, below
    # the tree's 14 + 16384 x 0.25 / (0.45 x 0.7) + 4096 = 17113.2 (NCCL's 0.7 from 16 KiB)
    assert allreduce_s(16383, 16, link) == ring_allreduce_s(16383, 16, link)
    assert allreduce_s(16384, 16, link) == pytest.approx(1.4 * 36 + 7680 + 3840, rel=1e-12)
    # a flat link has no trees; one machine's collective is its link's ring; one rank has nothing to reduce
    assert allreduce_s(1 << 20, 16, WIRE) == ring_allreduce_s(1 << 20, 16, WIRE)
    assert allreduce_s(0, 16, WIRE) == ring_allreduce_s(0, 16, WIRE) == 30 * 2.0
    assert allreduce_s(0, 4, c4 := _cluster().collective_link(4)) == ring_allreduce_s(0, 4, c4)
    assert allreduce_s(64, 1, link) == 0.0


def test_the_plateau_of_the_ring_hands_a_message_to_the_tree():
    """Two machines of one rank (R = M = 2): ring and tree wait alike (2 alpha_inter), the ring moves
    half the bytes the tree does; so the ring wins below NCCL's 64 bytes a channel a rank, and above it
    the tree wins until its bytes outweigh the ring's 1.4 x latency."""
    from paratrain.bench.costmodel import allreduce_s

    wire = Link(name="wire", alpha_s=100.0, beta_s_per_byte=0.01, gamma_s_per_byte=0.0)
    link = Cluster(intra=wire, inter=wire, devices_per_node=1, nics_per_node=1).collective_link(2)
    assert (link.tree_latency_s, link.channels, link.alpha_s) == (200.0, 4, 100.0)
    assert allreduce_s(511, 2, link) == ring_allreduce_s(511, 2, link) == pytest.approx(200 + 5.11, rel=1e-12)
    # 512 B (64 x 4 channels x 2 ranks): the ring 1.4 x 200 + 5.12 = 285.12, the tree 200 + 512 x 0.01 /
    # (0.45 x 0.9) = 212.6
    assert allreduce_s(512, 2, link) == pytest.approx(200 + 5.12 / 0.405, rel=1e-12)
    # 1 MiB: the tree's 200 + 10485.76 / (0.45 x 0.5) against the ring's 280 + 10485.76
    assert allreduce_s(1 << 20, 2, link) == pytest.approx(280 + 10485.76, rel=1e-12)


@pytest.mark.parametrize("nbytes, factor", [
    (0, 1.0), (63, 1.0), (64, 0.9), (127, 0.9), (8191, 0.9), (8192, 0.8), (16384, 0.7), (32768, 0.6),
    (128 << 10, 0.5), (1 << 20, 0.5), (2 << 20, 0.6), (4 << 20, 0.7), (8 << 20, 0.8), (16 << 20, 0.7),
    (25 << 20, 0.7), (64 << 20, 0.8), (128 << 20, 0.9), (256 << 20, 0.9), ((512 << 20) - 1, 0.9),
    (512 << 20, 1.0), (4 << 30, 1.0),
])
def test_the_trees_bandwidth_takes_nccls_correction_for_its_size(nbytes, factor):
    """NCCL 2.30's treeCorrectionFactor, Simple protocol, indexed by log2i(nBytes >> 6)."""
    from paratrain.bench.costmodel import tree_correction

    assert tree_correction(nbytes) == factor


@pytest.mark.parametrize("name, n, stages, tree", [
    ("ib400", 2, 1, 2 * 1 * 14e-6), ("ib400", 1024, 1, 2 * 10 * 14e-6), ("ib400", 1000, 1, 2 * 9 * 14e-6),
    ("eth25", 16, 1, 2 * 4 * 40e-6), ("ib400", 16, 2, 2 * 3 * 14e-6), ("ib400", 8, 8, 0.0),
])
def test_a_flat_network_preset_is_machines_of_one_device(name, n, stages, tree):
    """A flat ib400 or eth25 (every device on the network): NCCL's double binary trees over R = n / S
    ranks, one a machine, 2 floor(log2 R) alpha, and four channels of its one NIC; its alpha, beta and
    gamma are the preset's exactly. A flat nvlink or pcie5 is one machine: no trees."""
    preset = PRESETS[name]
    link = flat_collective_link(preset, n, stages)
    assert link.tree_latency_s == pytest.approx(tree, rel=1e-12, abs=1e-18) and link.channels == 4
    assert (link.name, link.alpha_s, link.beta_s_per_byte, link.gamma_s_per_byte) == (
        preset.name, preset.alpha_s, preset.beta_s_per_byte, preset.gamma_s_per_byte)
    assert flat_collective_link(preset, 1) is preset
    assert flat_collective_link(PRESETS["nvlink"], n, stages) is PRESETS["nvlink"]
    assert flat_collective_link(PRESETS["pcie5"], n, stages) is PRESETS["pcie5"]


def test_a_flat_network_at_a_thousand_devices_all_reduces_a_small_message_on_its_tree():
    from paratrain.bench.costmodel import allreduce_s

    ib = PRESETS["ib400"]
    # 0.29 ms (NCCL's base 8.4 us + 2 x 10 levels x 14 us), where its ring would wait 8.4 us + 2 x 1023 x 14 us
    # = 28.7 ms
    assert allreduce_s(0, 1024, flat_collective_link(ib, 1024)) == pytest.approx(288.4e-6, rel=1e-12)
    assert ring_allreduce_s(0, 1024, ib) == pytest.approx(28.6524e-3, rel=1e-12)


@pytest.mark.parametrize("per_node, cluster_s, flat_s", [
    (8, 8.4e-6 + 2 * (7 * 3.4e-6 + 14e-6), 8.4e-6 + 2 * 4 * 14e-6),  # 84 us against 120.4 us
    (14, 8.4e-6 + 2 * (13 * 3.4e-6 + 14e-6), 8.4e-6 + 2 * 4 * 14e-6),  # 124.8 us against 120.4 us
    (16, 8.4e-6 + 2 * (15 * 3.4e-6 + 14e-6), 8.4e-6 + 2 * 5 * 14e-6),  # 138.4 us against 148.4 us
    (32, 8.4e-6 + 2 * (31 * 3.4e-6 + 14e-6), 8.4e-6 + 2 * 6 * 14e-6),  # 247.2 us against 176.4 us
])
def test_a_machines_chain_in_nccls_tree_against_a_flat_networks_levels(per_node, cluster_s, flat_s):
    """NCCL's tree runs a chain of g - 1 hops inside each machine of g devices, where a flat ib400's tree
    has log2 g levels of the network in their place. At the presets' alphas, NCCL's own (an NVLink step
    3.4 us, a network's 14 us; both pay NCCL's base latency of 8.4 us once), a small all-reduce on two
    machines of nvlink+ib400 waits less than on a flat ib400 for machines of 8 and 16, and more for 14 and 32
    (7 x 3.4 = 23.8 us of chain against 3 x 14 = 42 us of levels; 13 x 3.4 = 44.2 against 3 x 14; 31 x 3.4
    = 105.4 against 5 x 14 = 70)."""
    from paratrain.bench.costmodel import allreduce_s

    c = cluster("nvlink+ib400", per_node)
    n = 2 * per_node
    assert allreduce_s(0, n, c.collective_link(n)) == pytest.approx(cluster_s, rel=1e-12)
    assert allreduce_s(0, n, flat_collective_link(PRESETS["ib400"], n)) == pytest.approx(flat_s, rel=1e-12)
    assert (cluster_s < flat_s) == (per_node in (8, 16))


def test_a_large_bucket_on_a_cluster_of_nvlink_machines_takes_the_tree_on_all_its_nics():
    """A bucket of 25 MiB on two machines of 8 (nvlink+ib400): the cluster's tree on 8 NICs, 400 GB/s a
    device at NCCL's 0.45 x 0.7 (25 MiB), 84 us of latency (NCCL's base 8.4 us and the tree's 75.6): 315 us; a
    flat ib400's ring at 50 GB/s waits its base and 1.4 x its 30 steps' latency of 14 us: 8.4 + 588 + 983 us of
    bytes + 22 us of reduction = 1602 us."""
    from paratrain.bench.costmodel import allreduce_s

    c = cluster("nvlink+ib400", 8)
    big, gamma = 25 << 20, PRESETS["ib400"].gamma_s_per_byte
    assert allreduce_s(big, 16, c.collective_link(16)) == pytest.approx(
        84e-6 + big / 400e9 / (0.45 * 0.7) + big * gamma, rel=1e-12)
    assert allreduce_s(big, 16, flat_collective_link(PRESETS["ib400"], 16)) == pytest.approx(
        8.4e-6 + 1.4 * 30 * 14e-6 + 2 * 15 / 16 * big / 50e9 + 15 / 16 * big * gamma, rel=1e-12)


def test_a_links_tree_latency_is_finite_and_not_negative():
    with pytest.raises(UsageError, match="tree_latency_s = -1.0 must be finite and >= 0"):
        Link(name="x", alpha_s=1.0, beta_s_per_byte=1.0, gamma_s_per_byte=0.0, tree_latency_s=-1.0, channels=1)
    for tree, channels in ((1.0, None), (None, 2), (1.0, 0), (1.0, 1.5), (1.0, True)):
        with pytest.raises(UsageError, match="gives tree_latency_s and channels"):
            Link(name="x", alpha_s=1.0, beta_s_per_byte=1.0, gamma_s_per_byte=0.0, tree_latency_s=tree,
                 channels=channels)


def test_every_collective_on_a_preset_pays_nccls_base_latency_once_and_a_measured_link_none():
    """NCCL's tuner (src/graph/tuning.cc, baseLatencies) charges each collective of its Simple protocol a
    base latency of 8.4 us on top of its steps, ring or tree, and PAT 8.0 us. By hand on ib400 (14 us a
    step, 50 GB/s) and on a measured link (its fitted alpha holds whatever a collective pays once: base 0).
    One rank runs no collective and pays nothing."""
    import dataclasses

    from paratrain.bench.costmodel import tree_allreduce_s, tree_broadcast_s
    from paratrain.bench.costmodel_sharded import ring_allgather_s, ring_reduce_scatter_s

    ib, m = PRESETS["ib400"], 1 << 20
    assert {p.base_latency_s for p in PRESETS.values()} == {8.4e-6}
    assert ring_allreduce_s(m, 4, ib) == pytest.approx(
        8.4e-6 + 6 * 14e-6 + 1.5 * m / 50e9 + 0.75 * m * ib.gamma_s_per_byte, rel=1e-12)
    assert ring_allgather_s(m, 4, ib) == pytest.approx(8.4e-6 + 3 * 14e-6 + 0.75 * m / 50e9, rel=1e-12)
    assert ring_reduce_scatter_s(m, 4, ib) == pytest.approx(
        8.4e-6 + 3 * 14e-6 + 0.75 * m * (1 / 50e9 + ib.gamma_s_per_byte), rel=1e-12)
    assert tree_broadcast_s(m, 5, ib) == pytest.approx(8.4e-6 + 3 * (14e-6 + m / 50e9), rel=1e-12)
    assert tree_allreduce_s(m, 4, ib) == pytest.approx(
        8.4e-6 + 4 * (14e-6 + m / 50e9) + 2 * m * ib.gamma_s_per_byte, rel=1e-12)
    no_base = dataclasses.replace(ib, base_latency_s=0.0)
    for f in (ring_allreduce_s, ring_allgather_s, ring_reduce_scatter_s, tree_broadcast_s, tree_allreduce_s):
        assert f(m, 1, ib) == 0.0, f.__name__
        assert f(m, 4, ib) - f(m, 4, no_base) == pytest.approx(8.4e-6, rel=1e-9), f.__name__  # once, not a step
    # a measured link (FAST, base 0): the plain formula, a ring all-reduce over 4 ranks 6 alpha + 1.5 m beta
    # + 0.75 m gamma
    assert ring_allreduce_s(8, 4, FAST) == 6 * 1.0 + 1.5 * 8 * 0.125 + 0.75 * 8 * 0.25


def test_a_clusters_collectives_carry_the_base_latency_and_a_link_stores_it():
    """A cluster's collective link across machines, and a pipeline's tied parameters' link over its stages,
    carry the base latency of their presets (8.4 us); Link(name, **terms()) is the link again; a negative
    one is refused."""
    c = cluster("nvlink+ib400", 8)
    assert c.collective_link(16).base_latency_s == 8.4e-6 == c.collective_link(4).base_latency_s
    link, placed = cluster_links(c, 16, stages=16)
    assert link.base_latency_s == placed["stages"].base_latency_s == 8.4e-6
    across = flat_collective_link(PRESETS["ib400"], 1024)
    assert across.terms()["base_latency_s"] == 8.4e-6 and Link(name=across.name, **across.terms()) == across
    assert "base_latency_s" not in FAST.terms()
    with pytest.raises(UsageError, match="base_latency_s = -1.0 must be finite and >= 0"):
        Link(name="x", alpha_s=1.0, beta_s_per_byte=1.0, gamma_s_per_byte=0.0, base_latency_s=-1.0)


def test_a_send_between_machines_goes_through_one_nic():  # (the link of a pair's send)
    c = _cluster(nics=8)
    assert c.p2p_link(True) == WIRE and c.p2p_link(False) == FAST


@pytest.mark.parametrize("n, stages, crossing", [
    (16, 2, 0),   # pipelines of 2 on machines of 4: ranks 0-1, 2-3 | 4-5, 6-7 ...
    (8, 4, 0),    # one pipeline a machine
    (12, 3, 1),   # ranks 3-5: the send 3 -> 4 crosses machines 0 and 1, the send 4 -> 5 does not
    (16, 8, 1),   # a pipeline of 8 on two machines of 4: 1 of its 7 sends crosses
    (16, 16, 3),  # one pipeline over four machines: 3 of 15
    (4, 2, 0),    # one machine
])
def test_a_pipelines_sends_cross_a_nic_only_where_its_stages_straddle_machines(n, stages, crossing):
    c = _cluster()
    link, links = cluster_links(c, n, stages)
    # its stage groups all-reduce side by side, as many on a machine's NICs as it holds stages
    assert link == c.collective_link(n, stages=stages)
    hops = stages - 1
    p2p = links["p2p"]
    # the mean hop: its S - 1 sends of m bytes cost c on the wire and the rest on the machine's link, exactly
    m = 8.0
    assert hops * (p2p.alpha_s + m * p2p.beta_s_per_byte) == pytest.approx(
        crossing * (2.0 + m * 1.0) + (hops - crossing) * (1.0 + m * 0.125), rel=1e-12)
    # the tied parameters' all-reduce over the replica's S stages on c + 1 machines: NCCL's latencies (a
    # ring's c + 1 - 1 steps of 2 (S-1) on the wire, a tree's chain of S // (c + 1) - 1 and its levels)
    # at one NIC's bandwidth
    tied = links["stages"]
    if not crossing:
        assert tied == FAST
    else:
        m = crossing + 1
        assert ring_allreduce_s(0, stages, tied) == pytest.approx(2 * ((stages - m) * 1.0 + (m - 1) * 2.0), rel=1e-12)
        assert tied.tree_latency_s == 2 * ((stages // m - 1) * 1.0 + (m.bit_length() - 1) * 2.0)
        assert (tied.beta_s_per_byte, tied.gamma_s_per_byte, tied.channels) == (1.0, 0.25, 4)
    assert links["rpc"] == links["broadcast"] == (WIRE if n > 4 else FAST)


def test_a_send_between_two_ranks_on_a_cluster_goes_over_one_nic_or_the_machines_link():
    c = _cluster()
    assert cluster_links(c, 8) == (c.collective_link(8), {"rpc": WIRE, "broadcast": WIRE})
    assert cluster_links(c, 4) == (FAST, {"rpc": FAST, "broadcast": FAST})


@pytest.mark.parametrize("k, n, nics", [(4, 5, 1), (4, 6, 2), (4, 7, 3), (4, 8, 4), (4, 12, 4), (4, 9, 1),
                                         (8, 6, 4), (2, 5, 1), (1, 7, 1)])
def test_a_machine_the_job_fills_in_part_drives_its_devices_share_of_the_nics(k, n, nics):
    c = _cluster(per_node=4, nics=k)  # the last machine holds n - 4 (or n - 8) of its 4 devices
    assert c.nics(n) == nics
    assert c.collective_link(n).beta_s_per_byte == max(0.125, 1.0 / nics)


def test_a_pipelines_stage_groups_share_a_machines_nics_by_hand():
    c = _cluster(per_node=4, nics=4)
    # 2 stages, 4 replicas on 2 machines: each machine holds both stages twice; 2 groups on 4 NICs
    assert cluster_links(c, 8, 2)[0].beta_s_per_byte == 1.0 * 2 / 4
    # 8 stages on 2 machines of 4, 2 replicas: a machine holds 4 stages, 4 groups on its 4 NICs, one each
    assert cluster_links(c, 16, 8)[0].beta_s_per_byte == 1.0 * 4 / 4
    # machines of 6 (6 NICs), 4 stages, 8 ranks: the full machine holds 4 groups on 6 NICs, 2 / 3 a NIC;
    # the second holds 2 devices, 2 groups on its devices' 2 NICs: 1 a NIC, the busier
    c6 = Cluster(intra=FAST, inter=WIRE, devices_per_node=6, nics_per_node=6)
    assert cluster_links(c6, 8, 4)[0].beta_s_per_byte == 1.0
    assert cluster_links(c6, 12, 4)[0].beta_s_per_byte == pytest.approx(4 / 6, rel=1e-12)  # two full machines


def test_a_pipelines_tied_parameters_ring_over_its_stages_on_the_stages_link():
    kw = dict(activation_bytes=1e6, shared_bytes=4e6, stage_param_bytes=[2e7, 2e7])
    on = predict_pipeline(W, 8, 2, 4, FAST, p2p_link=FAST, stage_link=FAST, **kw)
    across = predict_pipeline(W, 8, 2, 4, FAST, p2p_link=FAST, stage_link=WIRE, **kw)
    assert across.step_s - on.step_s == pytest.approx(ring_allreduce_s(4e6, 2, WIRE) - ring_allreduce_s(4e6, 2, FAST),
                                                      rel=1e-12)
    assert predict_pipeline(W, 8, 2, 4, FAST, **kw).step_s == on.step_s  # default: the replicas' link


def test_the_interconnect_names_a_preset_or_two_of_them():
    assert cluster("ib400", 8) is PRESETS["ib400"]
    c = cluster("nvlink+ib400", 8)
    assert (c.intra, c.inter, c.devices_per_node, c.nics_per_node) == (PRESETS["nvlink"], PRESETS["ib400"], 8, 8)
    assert cluster("pcie5+eth25", 4, 1).nics_per_node == 1
    # a DGX H100: 8 NICs of 50 GB/s feed 400 GB/s a device across machines, below NVLink's 450
    assert 1 / c.collective_link(16).beta_s_per_byte == pytest.approx(400e9)


@pytest.mark.parametrize("name, nics, said", [
    ("carrier-pigeon", None, "--interconnect 'carrier-pigeon' is unknown; use one of nvlink"),
    ("nvlink+pigeon", None, "--interconnect 'nvlink+pigeon': 'pigeon' unknown"),
    ("nvlink+ib400+eth25", None, "give at most two links"),
    ("measured+ib400", None, "measured is this machine's links, alone"),
    ("+", None, "--interconnect '+': INTRA+INTER needs two link names"),
    ("nvlink+", None, "INTRA+INTER needs two link names"),
    ("ib400", 2, "--nics-per-node 2: NICs price the network between machines; give a two-level"),
    ("measured", 1, "--nics-per-node 1: NICs price the network between machines; give a two-level"),
    ("nvlink+ib400", 0, "--nics-per-node 0: give the network ports of one machine, >= 1"),
])
def test_a_bad_interconnect_says_what_to_give(name, nics, said):
    with pytest.raises(UsageError) as e:
        cluster(name, 8, nics)
    assert said in str(e.value)


@pytest.mark.parametrize("name, said", [
    ("nvlink+ib400", "--interconnect 'nvlink+ib400': a cluster of machines (INTRA+INTER) is priced by paratrain "
                     "plan CONFIG --interconnect nvlink+ib400; paratrain predict takes one link: use one of "
                     "nvlink, pcie5, ib400, eth25, measured"),
    ("carrier-pigeon", "--interconnect 'carrier-pigeon' is unknown; use one of nvlink, pcie5, ib400, eth25, measured"),
    ("nvlink+pigeon", "--interconnect 'nvlink+pigeon': 'pigeon' unknown; use one of nvlink, pcie5, ib400, eth25, "
                      "measured"),
])
def test_one_link_is_a_flat_preset_or_measured(name, said):
    """``machines=False`` (paratrain predict): the flat presets and measured pass as with machines, a
    well-formed INTRA+INTER is refused naming paratrain plan, and no message offers INTRA+INTER."""
    assert cluster("ib400", 1, machines=False) is PRESETS["ib400"]
    assert cluster("measured", 1, machines=False) is None
    with pytest.raises(UsageError) as e:
        cluster(name, 1, machines=False)
    assert str(e.value) == said


def test_a_cluster_needs_a_device_and_a_nic_a_machine():
    with pytest.raises(UsageError):
        Cluster(intra=FAST, inter=WIRE, devices_per_node=0, nics_per_node=1)
    with pytest.raises(UsageError):
        _cluster().collective_link(8, stages=0)


def _step(link, links, cls, overrides, n):
    return step_parts(cls, Layout("x", n, dict(overrides)), W, link, Config(), INPUTS, links=links)["step_s"]


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([2, 4, 8, 16, 32]), per_node=st.sampled_from([1, 2, 4, 8]), nics=st.integers(1, 8),
       more=st.integers(1, 8), which=st.integers(0, len(LAYOUTS) - 1))
def test_more_nics_never_predict_a_slower_step(n, per_node, nics, more, which):
    cls, overrides = LAYOUTS[which]
    stages = overrides.get("pipeline_stages", 1)
    few = cluster_links(Cluster(intra=PRESETS["nvlink"], inter=PRESETS["ib400"], devices_per_node=per_node,
                                nics_per_node=nics), n, stages)
    many = cluster_links(Cluster(intra=PRESETS["nvlink"], inter=PRESETS["ib400"], devices_per_node=per_node,
                                 nics_per_node=nics + more), n, stages)
    assert _step(*many, cls, overrides, n) <= _step(*few, cls, overrides, n) * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([2, 4, 8, 16, 32]), per_node=st.sampled_from([1, 2, 4, 8]), nics=st.integers(1, 8),
       which=st.integers(0, len(LAYOUTS) - 1), pair=st.sampled_from([("nvlink", "ib400"), ("pcie5", "eth25"),
                                                                     ("nvlink", "eth25")]))
def test_a_clusters_step_lies_between_its_intra_node_links_and_its_networks(n, per_node, nics, which, pair):
    """Below: the same cluster with a network as fast as its machines' link (a flat intra-node link
    has no trees between machines, which can beat its 2 (n-1) ring steps). Above: the network alone, as
    the plan prices a flat network preset (machines of one device, :func:`flat_collective_link`), where
    a machine's chain in NCCL's tree, k - 1 hops of INTRA for its k ranks, waits no longer than the
    floor(log2 k) levels of the flat network's tree that it replaces (every pair and size here:
    test_a_machines_chain_in_nccls_tree_against_a_flat_networks_levels), and without NCCL's PAT, which
    gathers only where every machine holds one rank (the cluster's too at 1 device a
    machine)."""
    import dataclasses

    cls, overrides = LAYOUTS[which]
    intra, inter = PRESETS[pair[0]], PRESETS[pair[1]]
    c = Cluster(intra=intra, inter=inter, devices_per_node=per_node, nics_per_node=nics)
    stages = overrides.get("pipeline_stages", 1)
    step = _step(*cluster_links(c, n, stages), cls, overrides, n)
    fast = Cluster(intra=intra, inter=intra, devices_per_node=per_node, nics_per_node=nics)
    assert _step(*cluster_links(fast, n, stages), cls, overrides, n) <= step * (1 + 1e-12)
    chain = all((k - 1) * intra.alpha_s <= (k.bit_length() - 1) * inter.alpha_s for k in range(1, per_node + 1))
    if stages == 1 and chain:  # (a pipeline's stage groups share the NICs: below one each)
        flat = flat_collective_link(inter, n)
        flat = flat if per_node == 1 else dataclasses.replace(flat, pat_latency_s=None)
        assert step <= _step(flat, {}, cls, overrides, n) * (1 + 1e-12)
    if n <= per_node:  # one machine: the intra-node link's step exactly
        assert step == _step(intra, {}, cls, overrides, n)


def test_a_pipelines_sends_and_tied_ring_reach_its_formula_on_their_own_links():
    """step_parts (strategy_model) hands the formula ``links["p2p"]`` for the sends and
    ``links["stages"]`` for the tied parameters' ring and the step's small all-reduces over the stages (the
    loss and the 2 bubbles, 24 bytes of float64; with clipping the squared norm, 8 bytes), each apart from
    the replicas' link."""
    from .test_plan_model import _Cls
    from paratrain.bench.strategy_model import STAGES

    tied = {**INPUTS, "stage_profiles": {"2": {**INPUTS["stage_profiles"]["2"], "shared_bytes": 4e6}}}
    layout = Layout("x", 8, {"pipeline_stages": 2, "microbatches": 4})

    def step(links):
        return step_parts(_Cls(STAGES), layout, W, FAST, Config(), tied, links=links)["step_s"]

    base = step({})
    # 2 (S-1) = 2 sends of the activations' 1e6 bytes / 4 micro-batches each
    assert step({"p2p": WIRE}) - base == pytest.approx(2 * ((2.0 - 1.0) + 1e6 / 4 * (1.0 - 0.125)), rel=1e-9)
    small = (24, 8) if Config().train.clip > 0 else (24,)
    assert step({"stages": WIRE}) - base == pytest.approx(
        sum(ring_allreduce_s(b, 2, WIRE) - ring_allreduce_s(b, 2, FAST) for b in (4e6, *small)), rel=1e-9)
    # without tied parameters the small all-reduces remain: 2 (S-1) alphas and their bytes each
    plain = {**INPUTS, "stage_profiles": {"2": {**INPUTS["stage_profiles"]["2"], "shared_bytes": 0.0}}}
    untied = step_parts(_Cls(STAGES), layout, W, FAST, Config(), plain, links={"stages": WIRE})["step_s"]
    assert untied - step_parts(_Cls(STAGES), layout, W, FAST, Config(), plain, links={})["step_s"] == pytest.approx(
        sum(ring_allreduce_s(b, 2, WIRE) - ring_allreduce_s(b, 2, FAST) for b in small), rel=1e-9)
    # a recipe that clips: the squared norm's 8 bytes too
    import dataclasses

    clipping = dataclasses.replace(Config(), train=dataclasses.replace(Config().train, clip=0.25))

    def on(cfg, links):
        return step_parts(_Cls(STAGES), layout, W, FAST, cfg, plain, links=links)["step_s"]
    assert on(clipping, {"stages": WIRE}) - on(clipping, {}) == pytest.approx(
        sum(ring_allreduce_s(b, 2, WIRE) - ring_allreduce_s(b, 2, FAST) for b in (24, 8)), rel=1e-9)
    assert on(clipping, {}) - on(Config(), {}) == pytest.approx(ring_allreduce_s(8, 2, FAST), rel=1e-9)


def test_the_plan_prices_each_layout_on_the_links_its_ranks_span(monkeypatch):
    """plan.predict_layout with a Cluster: the layout's collectives' link and its placed links go to
    step_parts, and DDP's buffer broadcast gets one NIC's link across machines; a parameter server's
    messages are one NIC's, no faster than the host's measured exchange."""
    from paratrain.bench import plan

    from .test_plan_gpu import _gpu_profile

    seen, broadcast = [], []

    def step_parts(cls, layout, w, link, cfg, inputs, **kw):
        seen.append((layout.label, link, kw["links"]))
        return None

    def buffer_broadcast_s(prof, cfg, cls, n, link, on_this_machine):
        broadcast.append(link)
        return 0.0

    monkeypatch.setattr(plan, "step_parts", step_parts)
    monkeypatch.setattr(plan, "buffer_broadcast_s", buffer_broadcast_s)
    ib400, nvlink = PRESETS["ib400"], PRESETS["nvlink"]
    c = Cluster(intra=nvlink, inter=ib400, devices_per_node=2, nics_per_node=2)
    prof = _gpu_profile()
    for n in (2, 4):
        plan.predict_layout(plan.Layout("allreduce", n, {}, "allreduce"), prof, Config(), c, on_this_machine=False,
                            global_batch=None)
    # (the broadcast's link goes to buffer_broadcast_s alone)
    assert seen[0] == ("allreduce", nvlink, {"rpc": nvlink})
    assert seen[1][1] == c.collective_link(4) and seen[1][2] == {"rpc": ib400}
    assert broadcast == [nvlink, ib400]  # a tree's sends: one NIC across machines, not the rings' 2
    assert c.collective_link(4).beta_s_per_byte == ib400.beta_s_per_byte / 2
    # the host's exchange faster than a NIC (its round trip all update): the NIC paces the messages
    prof.update(links={"rpc": {"alpha_s": 1e-6, "beta_s_per_byte": 1e-15, "gamma_s_per_byte": 0.0}},
                ps_round_trip_s=0.01, ps_update_s={"async": 0.01})
    plan.predict_layout(plan.Layout("ps-sync", 4, {"num_ps": 1}, "ps-sync"), prof, Config(), c, on_this_machine=False,
                        global_batch=None)
    rpc = seen[-1][2]["rpc"]
    assert (rpc.alpha_s, rpc.beta_s_per_byte) == (ib400.alpha_s, ib400.beta_s_per_byte)
    # a slower exchange (40 MB each way in 0.09 s less the update 0.01 s and 2 x 0.5 ms) is their floor
    prof.update(links={"rpc": {"alpha_s": 5e-4, "beta_s_per_byte": 2e-12, "gamma_s_per_byte": 0.0}},
                ps_round_trip_s=0.09, ps_update_s={"async": 0.01})
    plan.predict_layout(plan.Layout("ps-sync", 4, {"num_ps": 1}, "ps-sync"), prof, Config(), c, on_this_machine=False,
                        global_batch=None)
    rpc = seen[-1][2]["rpc"]
    assert (rpc.alpha_s, rpc.beta_s_per_byte) == pytest.approx((5e-4, 0.079 / 80e6), rel=1e-9)


def test_the_plan_prices_a_flat_network_preset_as_machines_of_one_device(monkeypatch):
    """plan.predict_layout with a flat ib400: step_parts gets its trees over the layout's replicas
    (:func:`flat_collective_link`) and no placed links; a flat nvlink stays one machine's link."""
    from paratrain.bench import plan

    from .test_plan_gpu import _gpu_profile

    seen = []

    def step_parts(cls, layout, w, link, cfg, inputs, **kw):
        seen.append((link, kw["links"]))
        return None

    monkeypatch.setattr(plan, "step_parts", step_parts)
    ib400, nvlink = PRESETS["ib400"], PRESETS["nvlink"]
    for link, n in ((ib400, 1024), (ib400, 1), (nvlink, 1024)):
        plan.predict_layout(plan.Layout("allreduce", n, {}, "allreduce"), _gpu_profile(), Config(), link,
                            on_this_machine=False, global_batch=None)
    assert seen[0] == (flat_collective_link(ib400, 1024), {})
    assert seen[0][0].tree_latency_s == pytest.approx(2 * 10 * ib400.alpha_s, rel=1e-12)
    assert seen[1] == (ib400, {}) and seen[2] == (nvlink, {})
    # a pipeline of 8 stages, 2 replicas: the replicas' trees over 2 ranks, the tied parameters' over 8
    for link in (ib400, nvlink):
        plan.predict_layout(plan.Layout("pipeline", 16, {"pipeline_stages": 8}, "pipeline 2x8"), _gpu_profile(),
                            Config(), link, on_this_machine=False, global_batch=None)
    assert seen[3] == (flat_collective_link(ib400, 16, 8), {"stages": flat_collective_link(ib400, 8)})
    assert (seen[3][0].tree_latency_s, seen[3][1]["stages"].tree_latency_s) == pytest.approx((28e-6, 84e-6))
    assert seen[4] == (nvlink, {})


@pytest.mark.parametrize("which", [0, 1, 2, 4])  # allreduce, zero1, fsdp (the norm's all-reduce), a pipeline
def test_the_plans_all_reduces_take_a_clusters_tree_where_it_is_faster(which):
    """Each all-reduce a layout's formula prices goes through allreduce_s: on a link with trees of no
    latency and rings of 1 ms a step, every layout that all-reduces predicts a faster step."""
    import dataclasses

    cls, overrides = LAYOUTS[which]
    rings = Link(name="rings", alpha_s=1e-3, beta_s_per_byte=1e-12, gamma_s_per_byte=0.0)
    trees = dataclasses.replace(rings, tree_latency_s=0.0, channels=1)
    assert _step(trees, {}, cls, overrides, 8) < _step(rings, {}, cls, overrides, 8)


def test_synchronised_batchnorms_all_reduces_take_a_clusters_tree_where_it_is_faster():
    import dataclasses

    from paratrain.bench.costmodel import allreduce_s
    from paratrain.bench.plan_inputs import batchnorm_rings_s

    rings = Link(name="rings", alpha_s=1e-3, beta_s_per_byte=1e-12, gamma_s_per_byte=0.0)
    trees = dataclasses.replace(rings, tree_latency_s=1e-4, channels=1)
    prof = {"batchnorm_inputs": [[32, 16, 8, 8]]}  # one layer of C = 16 channels
    # its forward's C + 1 and C numbers and its backward's 2 C, 4 bytes each: three trees of 0.1 ms and their bytes
    assert batchnorm_rings_s(prof, Config(), 8, trees) == pytest.approx(
        sum(allreduce_s(b * 4, 8, trees) for b in (17, 16, 32)), rel=1e-12)
    assert batchnorm_rings_s(prof, Config(), 8, trees) == pytest.approx(  # (68, 64 and 128 B: NCCL's 0.9)
        3e-4 + (17 + 16 + 32) * 4 * 1e-12 / (0.45 * 0.9), rel=1e-12)
    assert batchnorm_rings_s(prof, Config(), 8, rings) == pytest.approx(
        3 * 14e-3 + (17 + 16 + 32) * 4 * 2 * 7 / 8 * 1e-12, rel=1e-12)


def test_flat_links_price_a_network_preset_as_machines_of_one_device():
    """flat_links, by hand (alpha 14 us): a job's collective link with NCCL's trees over its n / S
    replicas, and a pipeline's tied parameters over its S stages; a flat nvlink, or one device, as it is."""
    ib400, eth25, nvlink = PRESETS["ib400"], PRESETS["eth25"], PRESETS["nvlink"]
    assert flat_links(ib400, 1024) == (flat_collective_link(ib400, 1024), {})
    assert flat_links(ib400, 1024)[0].tree_latency_s == pytest.approx(280e-6, rel=1e-12)  # 2 x 10 levels
    assert flat_links(eth25, 4)[0].tree_latency_s == pytest.approx(160e-6, rel=1e-12)  # 2 x 2 levels of 40 us
    assert flat_links(ib400, 1) == (ib400, {}) and flat_links(nvlink, 1024) == (nvlink, {})
    link, placed = flat_links(ib400, 16, 8)  # 2 replicas of 8 stages
    assert (link.tree_latency_s, placed["stages"].tree_latency_s) == pytest.approx((28e-6, 84e-6), rel=1e-12)
    assert link.terms()["alpha_s"] == ib400.alpha_s and set(placed) == {"stages"}
    assert flat_links(ib400, 8, 8)[1] == {"stages": flat_collective_link(ib400, 8)}
    assert flat_links(nvlink, 16, 8) == (nvlink, {})


def _predict_args(**kw):
    import argparse

    return argparse.Namespace(**{"strategy": "allreduce", "algorithm": "ring", "bucket_mb": None, "num_ps": 1, **kw})


def test_predict_prices_a_flat_network_preset_on_nccls_trees_as_the_plan_does():
    """paratrain predict's curve (allreduce, --algorithm ring) on a flat ib400 puts each N's all-reduce on
    flat_links, as paratrain plan does. By hand, 40 KiB of gradients in one 1 MiB bucket at N = 1024: NCCL's
    base latency of 8.4 us and the tree's 2 x 10 levels of 14 us, plus 40960 B at 50 GB/s over 0.45 x NCCL's
    0.6 (40 KiB), plus the GPU's reduction = 291.47 us exposed after the backward; the ring alone waited
    2 x 1023 steps of 14 us (28.6 ms). ``--algorithm tree`` (a binomial tree) and ``ps`` price the preset as it is."""
    from paratrain.bench import predict_command
    from paratrain.bench.costmodel import Workload, predict

    ib = PRESETS["ib400"]
    w = Workload(forward_s=0.01, backward_s=0.02, data_s=0.0, optimizer_s=0.001, param_bytes=(4096,) * 10,
                 tokens_per_step=100)
    got = predict_command._curve(_predict_args(bucket_mb=1.0), Config(), None, ib, [1, 2, 1024])(w)
    assert [p.n for p in got] == [1, 2, 1024]
    assert got == [predict(w, n, flat_collective_link(ib, n), bucket_mb=1.0) for n in (1, 2, 1024)]
    hand = 8.4e-6 + 280e-6 + 40960 / 50e9 / (0.45 * 0.6) + 40960 * 3 / 3.35e12
    assert got[-1].exposed_comm_s == pytest.approx(hand, rel=1e-9)
    assert predict(w, 1024, ib, bucket_mb=1.0).exposed_comm_s > 20e-3
    for algorithm in ("tree", "ps"):
        alone = predict_command._curve(_predict_args(bucket_mb=1.0, algorithm=algorithm), Config(), None, ib, [1024])
        assert alone(w) == [predict(w, 1024, ib, algorithm=algorithm, bucket_mb=1.0)]


def test_predicts_pipeline_on_a_flat_network_preset_takes_the_plans_links(monkeypatch):
    """paratrain predict --strategy pipeline on a flat ib400 hands the formula flat_links' links at each
    N: the replicas' trees and the tied parameters' over the S stages (and a flat nvlink as it is)."""
    import dataclasses

    from paratrain.bench import predict_command, strategy_model

    seen = []
    monkeypatch.setattr(strategy_model, "strategy_inputs", lambda task, cfg, device: {
        "activation_bytes": 1.0, "stage_fractions": [0.25] * 4, "stage_param_bytes": [1.0] * 4,
        "microbatch_factor": 1.0})
    monkeypatch.setattr(strategy_model, "predict_strategy",
                        lambda strategy, w, n, link, cfg, inputs, **kw: seen.append((n, link, kw["links"])))
    base = Config()
    cfg = dataclasses.replace(base, dist=dataclasses.replace(base.dist, strategy="pipeline", pipeline_stages=4, nproc=4,
                                                                  device="cpu"))
    for link in (PRESETS["ib400"], PRESETS["nvlink"]):
        predict_command._curve(_predict_args(strategy="pipeline"), cfg, None, link, [1, 2, 4, 8, 16])(W)
    ib400 = PRESETS["ib400"]
    assert seen[:3] == [(n, *flat_links(ib400, n, 4)) for n in (4, 8, 16)]
    assert seen[2][2]["stages"].tree_latency_s == pytest.approx(56e-6, rel=1e-12)  # 2 x 2 levels of 14 us
    assert seen[3:] == [(n, PRESETS["nvlink"], {}) for n in (4, 8, 16)]


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_predicts_sync_batchnorm_on_a_flat_network_preset_takes_the_links_of_its_gradients(monkeypatch, algorithm):
    """paratrain predict's model.sync_batchnorm term on a flat ib400 is priced on the link its gradients
    are: with --algorithm ring flat_links' (NCCL's trees over N one-device machines, as paratrain plan
    prices it); with a binomial tree the preset as it is."""
    from paratrain import runs
    from paratrain.bench import plan_inputs, predict_command, profile

    seen = {}
    monkeypatch.setattr(runs, "build_task", lambda cfg, data_dir, world_size: None)
    monkeypatch.setattr(profile, "batchnorm_inputs_of", lambda task, cfg: [[32, 16, 8, 8]])
    monkeypatch.setattr(plan_inputs, "sync_batchnorm_s",
                        lambda prof, cfg, n, link, measured: seen.setdefault(n, link) and 0.0)
    ib = PRESETS["ib400"]
    args = _predict_args(algorithm=algorithm, interconnect="ib400", data_dir=None)
    assert predict_command._sync_batchnorm_terms(args, Config(), ib, [1, 2, 64]) == {1: 0.0, 2: 0.0, 64: 0.0}
    assert seen == {n: (flat_collective_link(ib, n) if algorithm == "ring" else ib) for n in (1, 2, 64)}
    assert seen[64].tree_latency_s == (pytest.approx(2 * 6 * 14e-6, rel=1e-12) if algorithm == "ring" else None)


@pytest.mark.parametrize("ranks, alpha, expected", [
    (2, 14e-6, 8e-6 + 14e-6 / 3.5 + 2 * 2.8e-6),  # 17.6 us
    (3, 14e-6, 8e-6 + 14e-6 / 3.5 + 3 * 2.8e-6),  # 20.4 us: floor(log2 3) = 1 level
    (1024, 14e-6, 8e-6 + 10 * 14e-6 / 3.5 + 1024 * 2.8e-6),  # 2915.2 us, against the ring's 8.4 + 1023 x 14 us
    (16, 40e-6, 8e-6 + 4 * 40e-6 / 3.5 + 16 * 2.8e-6),  # eth25
])
def test_nccls_pat_latency_by_hand(ranks, alpha, expected):
    """NCCL's PAT (tuning.cc): its base latency of 8.0 us, log2i(M) levels at the network tree's latency / 3.5,
    plus 2.8 us a rank."""
    from paratrain.bench.costmodel_links import pat_latency_s

    assert pat_latency_s(ranks, alpha) == pytest.approx(expected, rel=1e-12)


def test_pat_is_priced_where_every_machine_holds_one_rank():
    """A flat ib400 (machines of one device), a cluster of one device a machine and a pipeline's stage
    group spread one rank a machine carry NCCL's PAT latency over the group's R ranks; machines of
    several ranks of the group, one machine, a flat nvlink and a group of one rank do not (NCCL runs PAT
    only where nNodes == nRanks)."""
    ib = PRESETS["ib400"]
    assert flat_collective_link(ib, 1024).pat_latency_s == pytest.approx(2915.2e-6, rel=1e-12)
    assert flat_collective_link(ib, 16, 8).pat_latency_s == pytest.approx(17.6e-6, rel=1e-12)  # 2 replicas
    assert flat_collective_link(ib, 8, 8).pat_latency_s is None  # one replica: nothing to gather
    assert flat_collective_link(PRESETS["nvlink"], 1024).pat_latency_s is None
    assert cluster("nvlink+ib400", 1).collective_link(16).pat_latency_s == pytest.approx(
        8e-6 + 4 * 14e-6 / 3.5 + 16 * 2.8e-6, rel=1e-12)
    assert cluster("nvlink+ib400", 8).collective_link(16).pat_latency_s is None
    assert cluster("nvlink+ib400", 8).collective_link(8).pat_latency_s is None
    # 8 replicas of 8 stages on machines of 8: stage s's replicas are ranks r 8 + s, one on each machine
    assert cluster("nvlink+ib400", 8).collective_link(64, 8).pat_latency_s == pytest.approx(
        8e-6 + 3 * 14e-6 / 3.5 + 8 * 2.8e-6, rel=1e-12)
    assert cluster("nvlink+ib400", 8).collective_link(64, 4).pat_latency_s is None  # 2 of a group a machine


def test_an_all_gather_takes_pat_where_it_is_faster():
    """By hand on a flat ib400 (14 us, 50 GB/s; NCCL's base latency 8.4 us, PAT's 8.0): at R = 2, 64 KiB take
    PAT's 17.6 us + 65536 B / (0.75 x 50 GB/s) = 19.35 us against the ring's 8.4 + 14 us + 32768 B / 50 GB/s
    = 23.06 us; 1 MiB takes the ring's 32.89 us against PAT's 45.56 us. At R = 1024 a small gather takes
    PAT's 2.9 ms against 14.3 ms."""
    from paratrain.bench.costmodel_sharded import allgather_s, ring_allgather_s

    ib = PRESETS["ib400"]
    two, many = flat_collective_link(ib, 2), flat_collective_link(ib, 1024)
    small, big = 1 << 16, 1 << 20
    assert allgather_s(small, 2, two) == pytest.approx(17.6e-6 + small * 2e-11 / 0.75, rel=1e-12)
    assert ring_allgather_s(small, 2, two) == pytest.approx(22.4e-6 + small / 2 * 2e-11, rel=1e-12)
    assert allgather_s(big, 2, two) == ring_allgather_s(big, 2, two) == pytest.approx(22.4e-6 + big / 2 * 2e-11)
    assert allgather_s(0, 1024, many) == pytest.approx(2915.2e-6, rel=1e-12)
    assert ring_allgather_s(0, 1024, many) == pytest.approx(14330.4e-6, rel=1e-12)
    for link in (ib, PRESETS["nvlink"]):  # no PAT: the ring
        assert allgather_s(small, 1024, link) == ring_allgather_s(small, 1024, link)


@pytest.mark.parametrize("which", [1, 2])  # zero1's all-gather, fsdp's all-gathers
def test_the_sharded_layouts_gather_on_pat_on_a_flat_network_and_fsdp_scatters_on_the_ring(which):
    """zero1 and fsdp on a flat ib400 at 1024 devices: their all-gathers take PAT where it is faster, so
    the step is shorter than on the same link without PAT (rings only). FSDP2's reduce-scatters average
    (ReduceOp.AVG, a pre-multiplied sum in NCCL), which NCCL keeps on the ring (src/enqueue.cc): a
    reduce-scatter link with PAT prices them as one without."""
    import dataclasses

    cls, overrides = LAYOUTS[which]
    link = flat_collective_link(PRESETS["ib400"], 1024)
    rings = dataclasses.replace(link, pat_latency_s=None)
    assert _step(link, {}, cls, overrides, 1024) < _step(rings, {}, cls, overrides, 1024)
    if which == 2:
        both = {"all_gather": rings, "reduce_scatter": rings}
        assert _step(rings, {**both, "all_gather": link}, cls, overrides, 1024) < _step(rings, both, cls, overrides,
                                                                                      1024)
        assert _step(rings, {**both, "reduce_scatter": link}, cls, overrides, 1024) == _step(rings, both, cls,
                                                                                           overrides, 1024)
