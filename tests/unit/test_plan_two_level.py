"""A two-level cluster (``--interconnect INTRA+INTER``): the link each collective is priced on, by
hand, and its properties: more NICs never predict a slower step, and a cluster's step lies between
its intra-node link's alone and its network's alone.

The made-up links use powers of two so that the hand-computed times are exact in floating point."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.bench.costmodel import PRESETS, Link, ring_allreduce_s
from paratrain.bench.costmodel_cluster import Cluster, cluster
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
    assert (link.alpha_s, link.beta_s_per_byte, link.gamma_s_per_byte) == (2.0, beta, 0.25)
    assert link.name == "fast+wire (2 nodes)"
    # 8 ranks, 8 bytes: 2 (n-1) alpha + 2 (n-1)/n m beta + (n-1)/n m gamma
    assert ring_allreduce_s(8, 8, link) == 14 * 2.0 + 14 * beta + 7 * 0.25


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
    assert links["stages"] == (WIRE if crossing else FAST)  # a ring over the stages: its slowest hop
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
    ("nvlink+ib400", 0, "--nics-per-node 0: give the network ports of one machine, >= 1"),
])
def test_a_bad_interconnect_says_what_to_give(name, nics, said):
    with pytest.raises(UsageError) as e:
        cluster(name, 8, nics)
    assert said in str(e.value)


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
    cls, overrides = LAYOUTS[which]
    intra, inter = PRESETS[pair[0]], PRESETS[pair[1]]
    c = Cluster(intra=intra, inter=inter, devices_per_node=per_node, nics_per_node=nics)
    step = _step(*cluster_links(c, n, overrides.get("pipeline_stages", 1)), cls, overrides, n)
    assert _step(intra, {}, cls, overrides, n) <= step * (1 + 1e-12)
    if overrides.get("pipeline_stages", 1) == 1:  # (a pipeline's stage groups share the NICs: below one each)
        assert step <= _step(inter, {}, cls, overrides, n) * (1 + 1e-12)
    if n <= per_node:  # one machine: the intra-node link's step exactly
        assert step == _step(intra, {}, cls, overrides, n)


def test_a_pipelines_sends_and_tied_ring_reach_its_formula_on_their_own_links():
    """step_parts (strategy_model) hands the formula ``links["p2p"]`` for the sends and
    ``links["stages"]`` for the tied parameters' ring, each apart from the replicas' link."""
    from .test_plan_model import _Cls
    from paratrain.bench.strategy_model import STAGES

    tied = {**INPUTS, "stage_profiles": {"2": {**INPUTS["stage_profiles"]["2"], "shared_bytes": 4e6}}}
    layout = Layout("x", 8, {"pipeline_stages": 2, "microbatches": 4})

    def step(links):
        return step_parts(_Cls(STAGES), layout, W, FAST, Config(), tied, links=links)["step_s"]

    base = step({})
    # 2 (S-1) = 2 sends of the activations' 1e6 bytes / 4 micro-batches each
    assert step({"p2p": WIRE}) - base == pytest.approx(2 * ((2.0 - 1.0) + 1e6 / 4 * (1.0 - 0.125)), rel=1e-9)
    assert step({"stages": WIRE}) - base == pytest.approx(
        ring_allreduce_s(4e6, 2, WIRE) - ring_allreduce_s(4e6, 2, FAST), rel=1e-9)


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
    assert seen[0] == ("allreduce", nvlink, {"rpc": nvlink, "broadcast": nvlink})
    assert seen[1][1] == c.collective_link(4) and seen[1][2] == {"rpc": ib400, "broadcast": ib400}
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
