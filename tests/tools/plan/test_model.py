"""The projection formula (`refit_tools.plan.model`) on hand-made constants: each stage, the
bound, the latency terms, the reference and how they move with the inputs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from refit_sidecar.transport.relay import tree
from refit_tools.plan.model import (
    Constants,
    Deployment,
    first_region,
    last_region,
    payload_count,
    payloads_per_producer,
    project,
    tree_children,
    tree_depth,
)
from refit_tools.plan.projection import product_sizes

MIB = 1 << 20
CROSS, INTRA = 10e9 / 8, 100e9 / 8
K = Constants(
    v_over_h=0.02,
    link_overhead=1.05,
    payload_overhead_s=0.001,
    construction_bytes_s=5e9,
    apply_bytes_s=50e9,
    startup_fixed_s=0.04,
    finalization_s_per_byte=1e-10,
)
D = Deployment(
    model_bytes=10**12,
    change_rate=0.03,
    producers=8,
    nodes=8,
    cross_bytes_s=CROSS,
    intra_bytes_s=INTRA,
    chunk_bytes=256 * MIB,
    bucket_bytes=512 * MIB,
)


def test_tree_shape_is_the_relay_tree() -> None:
    for n in range(1, 40):
        assert tree_depth(n) == tree.depth(n) == math.ceil(math.log2(n + 1))
        most = max(len(tree.children(i, 0, n)) for i in range(n))
        assert tree_children(n) == most


def test_stages_follow_the_formula() -> None:
    b = project(D, K)
    h, v = 1e12, 0.02e12
    n_p = payloads_per_producer(D.model_bytes, 8, D.bucket_bytes)
    assert b.v_payload_bytes == pytest.approx(v)
    assert b.payloads == 8 * n_p == 8 * math.ceil(h / 8 / (512 * MIB))
    assert b.stages["construction"] == pytest.approx(h / 8 / 5e9)
    assert b.stages["cross-cluster"] == pytest.approx(v * 1.05 / CROSS + n_p * 0.001)
    assert b.stages["fan-out"] == pytest.approx(2 * v / INTRA)
    assert b.stages["apply"] == pytest.approx(h / 50e9)
    assert b.bound == "construction" == max(b.stages, key=b.stages.__getitem__)
    assert b.latency_s == pytest.approx(b.startup_s + b.stream_s + b.drain_s + b.finalization_s)
    # Start-up builds the first payload; the stream counts the rest of the bounding stage.
    assert b.startup_s == pytest.approx(0.04 + first_region(D) / 5e9)
    assert b.stream_s == pytest.approx(b.stages["construction"] - first_region(D) / 5e9)
    last_wire = 0.02 * last_region(D)
    assert b.drain_s == pytest.approx(3 * last_wire / INTRA + last_region(D) / 50e9)
    assert b.finalization_s == pytest.approx(1e-10 * h / 8)
    assert b.reference_s == pytest.approx(h * 1.05 / CROSS + 3 * (512 * MIB) / INTRA)
    assert b.speedup == pytest.approx(b.reference_s / b.latency_s)
    assert b.link_limit == pytest.approx(1 / 0.02)


def test_a_slow_link_bounds_the_stream() -> None:
    slow = dataclasses.replace(D, cross_bytes_s=1e9 / 8)
    b = project(slow, K)
    assert b.bound == "cross-cluster"
    assert b.stream_s == pytest.approx(b.stages["cross-cluster"])
    # Link-bound on both sides: the speedup approaches the link limit H / V_payload.
    assert 0.8 * b.link_limit < b.speedup < b.link_limit


def test_inputs_move_the_projection_the_right_way() -> None:
    base = project(D, K)
    more_producers = project(dataclasses.replace(D, producers=16), K)
    assert more_producers.stages["construction"] == pytest.approx(base.stages["construction"] / 2)
    assert more_producers.finalization_s == pytest.approx(base.finalization_s / 2)
    more_nodes = project(dataclasses.replace(D, nodes=64), K)
    assert more_nodes.cross_bytes == base.cross_bytes  # relay: each payload crosses once
    assert more_nodes.tree_depth == 7
    assert more_nodes.drain_s > base.drain_s
    higher_rate = project(
        dataclasses.replace(D, change_rate=0.05), dataclasses.replace(K, v_over_h=0.03)
    )
    assert higher_rate.v_payload_bytes > base.v_payload_bytes
    latencies = [
        project(dataclasses.replace(D, cross_bytes_s=r), K).latency_s
        for r in (1e7, 1e8, 1e9, 1e10, 1e11)
    ]
    assert latencies == sorted(latencies, reverse=True)


def test_one_node_has_no_fan_out() -> None:
    b = project(dataclasses.replace(D, nodes=1), K)
    assert b.stages["fan-out"] == 0
    assert b.tree_depth == 1


def test_relay_hop_throughput_bounds_fan_out_and_each_flow() -> None:
    k = dataclasses.replace(K, hop_bytes_s=0.5e9, hop_payload_s=0.002)
    b = project(dataclasses.replace(D, cross_bytes_s=None), k)
    v = 0.02e12
    assert b.stages["fan-out"] == pytest.approx(2 * v / 0.5e9 + b.payloads * 0.002)
    n_p = b.payloads // 8
    assert b.stages["cross-cluster"] == pytest.approx(v / 8 / 0.5e9 + n_p * 0.001)


def test_mac_only_links_take_the_mac_only_hop_inside_the_cluster() -> None:
    """Relay to relay the policy's mode decides the hop; the roots' receive from the trainers
    is always the encrypted hop."""
    k = dataclasses.replace(K, hop_bytes_s=0.5e9, hop_mac_bytes_s=1.2e9)
    d = dataclasses.replace(D, cross_bytes_s=None)
    mac = project(d, k)
    enc = project(dataclasses.replace(d, intra_cluster="encrypted"), k)
    v = 0.02e12
    assert mac.stages["fan-out"] == pytest.approx(2 * v / 1.2e9)
    assert enc.stages["fan-out"] == pytest.approx(2 * v / 0.5e9)
    assert mac.stages["cross-cluster"] == enc.stages["cross-cluster"]
    unmeasured = project(d, dataclasses.replace(k, hop_mac_bytes_s=None))
    assert unmeasured.stages["fan-out"] == enc.stages["fan-out"]  # the encrypted hop stands in


def test_s3_downloads_cross_once_per_node() -> None:
    k = dataclasses.replace(K, s3_upload_bytes_s=1e9, s3_download_bytes_s=2e9)
    b = project(dataclasses.replace(D, transport="s3"), k)
    assert b.cross_bytes == pytest.approx(8 * 0.02e12 * 1.05)
    assert set(b.stages) == {"construction", "upload", "cross-cluster", "fan-out", "apply"}
    assert b.link_limit == pytest.approx(50)
    with pytest.raises(ValueError, match="S3"):
        project(dataclasses.replace(D, transport="s3"), K)


def test_regions() -> None:
    small = Deployment(
        model_bytes=600 * MIB,
        change_rate=0.03,
        producers=1,
        nodes=3,
        cross_bytes_s=None,
        intra_bytes_s=None,
        chunk_bytes=32 * MIB,
        bucket_bytes=32 * MIB,
        last_tensor_bytes=125 * MIB,
    )
    assert first_region(small) == 32 * MIB
    assert last_region(small) == 125 * MIB  # the output head is applied after the last send
    assert last_region(dataclasses.replace(small, last_tensor_bytes=None)) == 32 * MIB
    big = dataclasses.replace(small, chunk_bytes=256 * MIB, bucket_bytes=512 * MIB)
    assert first_region(big) == 512 * MIB
    assert first_region(dataclasses.replace(big, model_bytes=100 * MIB)) == 100 * MIB
    # Split into parts (the producer's auto: the chunk limit), the head's last part is what
    # the drain applies, and a large embedding no longer makes the first payload large.
    split = dataclasses.replace(small, split_bytes=32 * MIB, first_tensor_bytes=125 * MIB)
    assert last_region(split) == 32 * MIB
    assert first_region(split) == 32 * MIB
    assert first_region(dataclasses.replace(split, split_bytes=None)) == 125 * MIB


def test_auto_sizes_are_the_producers() -> None:
    from refit_sidecar.baseline.sizing import resolve_sizes

    for h, p in ((10**12, 8), (622_891_008, 1), (155_731_968, 1), (60 * 10**9, 4)):
        want = resolve_sizes("auto", "auto", total_bytes=h, producers=p)
        got = product_sizes(h, p, "auto", "auto")
        assert got[:2] == (want.chunk_bytes, want.bucket_bytes)
    assert product_sizes(10**12, 8, 32 * MIB, 64 * MIB)[:2] == (32 * MIB, 64 * MIB)


def test_regions_of_a_known_layout_replace_the_estimates() -> None:
    d = dataclasses.replace(
        D, producers=1, model_bytes=600 * MIB, regions=(125 * MIB, 300 * MIB, 175 * MIB)
    )
    assert payload_count(d) == 3
    assert first_region(d) == 125 * MIB
    assert last_region(d) == 175 * MIB
    assert project(d, K).payloads == 3
    # Without them: the chunk / bucket estimate, and a first tensor larger than a chunk.
    est = dataclasses.replace(d, regions=None, chunk_bytes=32 * MIB, bucket_bytes=32 * MIB)
    assert payload_count(est) == 19
    assert first_region(est) == 32 * MIB
    assert first_region(dataclasses.replace(est, first_tensor_bytes=125 * MIB)) == 125 * MIB


def test_shared_cpus_add_up_the_cpu_stages() -> None:
    """On one machine (the bench) the CPU stages take turns: their machine-seconds add up."""
    k = dataclasses.replace(
        K,
        construction_bytes_s=2e9,
        apply_bytes_s=3e9,
        apply_payload_s=0.002,
        hop_bytes_s=0.5e9,
        hop_payload_s=0.0003,
        drain_fixed_s=0.01,
        drain_bytes_s=1.5e9,
        stream_fixed_s=0.005,
    )
    d = Deployment(
        model_bytes=600 * MIB,
        change_rate=0.03,
        producers=1,
        nodes=3,
        cross_bytes_s=None,
        intra_bytes_s=None,
        chunk_bytes=32 * MIB,
        bucket_bytes=32 * MIB,
        regions=(125 * MIB,) + (25 * MIB,) * 14 + (125 * MIB,),
    )
    alone = project(d, k)
    assert "shared CPU" not in alone.stages
    shared = project(dataclasses.replace(d, shared_cpus=2), k)
    h, v, n_p = 600 * MIB, 0.02 * 600 * MIB, 16
    construction_rest = (h - 125 * MIB) / 2e9
    apply_rest = h / 3e9 + n_p * 0.002 - 125 * MIB / 3e9 - 0.002
    relay = 3 * (v / 0.5e9 + n_p * 0.0003)
    assert shared.stages["shared CPU"] == pytest.approx(
        construction_rest + 3 / 2 * apply_rest + relay
    )
    assert shared.bound == "shared CPU"
    assert shared.stream_s == pytest.approx(shared.stages["shared CPU"])
    assert shared.stream_s > alone.stream_s
    # The last apply runs on all three nodes at once on two CPUs.
    hops = 1 * (0.02 * 125 * MIB / 0.5e9 + 0.0003)
    assert alone.drain_s == pytest.approx(0.01 + hops + 125 * MIB / 1.5e9)
    assert shared.drain_s == pytest.approx(0.01 + hops + 1.5 * 125 * MIB / 1.5e9)
    # A slow link still bounds it.
    slow = project(dataclasses.replace(d, shared_cpus=2, cross_bytes_s=1e6), k)
    assert slow.bound == "cross-cluster"
    assert slow.stages["cross-cluster"] == pytest.approx(v * 1.05 / 1e6 + 0.005 + n_p * 0.001)


def test_the_breakdown_says_what_the_relay_hop_bounds() -> None:
    """A relay hop slower than the intra-cluster link paces fan-out and, when it is the
    slowest leg, the full-checkpoint reference; a slower link leaves them to the link."""
    k = dataclasses.replace(K, hop_bytes_s=0.5e9)
    b = project(D, k)  # 100 Gbit/s inside, 10 Gbit/s between: the hop is slower than both
    assert b.hop_bound == {"fan-out": "intra", "reference": "intra"}
    assert b.stages["fan-out"] == pytest.approx(2 * 0.02e12 / 0.5e9)
    assert b.reference_s == pytest.approx(2 * 1e12 / 0.5e9 + 3 * (512 * MIB) / 0.5e9)
    assert project(D, K).hop_bound == {}  # no relay hop measured
    slow_intra = project(dataclasses.replace(D, intra_bytes_s=0.25e9), k)
    assert "fan-out" not in slow_intra.hop_bound
    assert "reference" not in slow_intra.hop_bound
    # One node, one producer: no fan-out, but the root's receive of the whole flow.
    single = project(dataclasses.replace(D, nodes=1, producers=1, cross_bytes_s=100e9 / 8), k)
    assert single.hop_bound == {"cross-cluster": "cross", "reference": "cross"}
    # A slow cross-cluster link bounds the reference itself.
    slow_cross = project(dataclasses.replace(D, cross_bytes_s=1e9 / 8), k)
    assert slow_cross.hop_bound == {"fan-out": "intra"}
