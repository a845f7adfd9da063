"""Attach mode and the mini-lb router, against the session's real cluster."""

import time

import pytest

from kvchaos.cluster import AttachedCluster, ClusterSpec
from kvchaos.cluster.api import wait_healthy
from kvchaos.cluster.argv import engine_env, router_argv
from kvchaos.cluster.ports import release_ports, reserve_ports
from kvchaos.cluster.procs import ManagedProcess

pytestmark = pytest.mark.cluster


def test_attach_mode_serves_and_never_kills(cluster):
    e = cluster.endpoints
    a = AttachedCluster.parse(f"router={e.router},prefill={e.prefill},decode={e.decode}").start(timeout_s=10)
    r = a.generate(text="attach mode check, with canary [ABCDEFGHIJ] inside some filler text [", max_new_tokens=16)
    assert r.status_code == 200 and "ABCDEFGHIJ" in r.json()["text"]
    assert a.server_info("decode")["disaggregation_mode"] == "decode"
    a.stop()
    cluster.check_alive()
    assert cluster.generate(text="still here", max_new_tokens=2).status_code == 200


def test_attach_to_nothing_fails_with_a_bound():
    (port,) = reserve_ports(1)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        with pytest.raises(Exception, match="no healthy answer within 2s"):
            AttachedCluster.parse(f"router={url},prefill={url},decode={url}").start(timeout_s=2)
        assert time.monotonic() - t0 < 10
    finally:
        release_ports([port])


def test_mini_lb_is_selectable(cluster, tmp_path):
    spec = ClusterSpec.load("cpu", router="mini-lb")
    e = cluster.endpoints
    (port,) = ports = reserve_ports(1)
    p = ManagedProcess("mini-lb", router_argv(spec, e.prefill, e.bootstrap_port, e.decode, port), engine_env(spec),
                       tmp_path / "mini-lb.log", None, "kvc-test-minilb")
    try:
        assert "--mini-lb" in p.argv
        wait_healthy({"lb": p}, {"lb": f"http://127.0.0.1:{port}/health"}, time.monotonic() + 120)
        lb = AttachedCluster.parse(f"router=http://127.0.0.1:{port},prefill={e.prefill},decode={e.decode}")
        via_lb = lb.generate(text="same prompt, two routers", max_new_tokens=8).json()["output_ids"]
        via_router = cluster.generate(text="same prompt, two routers", max_new_tokens=8).json()["output_ids"]
        assert via_lb == via_router
    finally:
        p.stop(grace_s=3)
        release_ports(ports)
