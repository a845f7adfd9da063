import pytest

from kvchaos.cluster import ClusterSpec, SpecError
from kvchaos.cluster.argv import engine_env, router_argv, server_argv


def test_cpu_profile_loads_with_measured_flags():
    s = ClusterSpec.load("cpu")
    assert (s.device, s.transfer_backend, s.router, s.cpu_compat) == ("cpu", "mooncake_tcp", "sglang-router", True)
    assert s.pool_tokens < s.context_length  # the incident's shape: pool smaller than context
    argv = server_argv(s, "/m", "decode", 1234)
    for flag in ("--attention-backend", "--disable-cuda-graph", "--disable-overlap-schedule", "--sleep-on-idle",
                 "--disaggregation-decode-retraction-backup"):
        assert flag in argv
    assert argv[argv.index("--disaggregation-mode") + 1] == "decode"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_decode_reservation_is_the_deployed_flag_else_sglangs_default():
    cpu = ClusterSpec.load("cpu")
    argv = server_argv(cpu, "/m", "decode", 1234)
    assert cpu.decode_reservation == int(argv[argv.index("--num-reserved-decode-tokens") + 1]) == 128
    assert "--num-reserved-decode-tokens" not in server_argv(cpu, "/m", "prefill", 1, bootstrap_port=2)  # decode's
    assert ClusterSpec.load("gpu").decode_reservation == 512  # not set: SGLang's default
    assert ClusterSpec.load("cpu", decode_args=["--num-reserved-decode-tokens=64"]).decode_reservation == 64
    assert ClusterSpec.load("cpu", decode_args=["--num-reserved-decode-tokens", "16",
                                                "--num-reserved-decode-tokens", "32"]).decode_reservation == 32


def test_gpu_profile_is_rdma_cuda_without_cpu_compat():
    s = ClusterSpec.load("gpu", ib_device="mlx5_0")
    assert (s.device, s.transfer_backend, s.cpu_compat) == ("cuda", "mooncake", False)
    argv = server_argv(s, "/m", "prefill", 1, bootstrap_port=2)
    assert argv[argv.index("--disaggregation-ib-device") + 1] == "mlx5_0"
    assert argv[argv.index("--disaggregation-bootstrap-port") + 1] == "2"
    assert "--sleep-on-idle" not in argv
    assert "KVCHAOS_CPU_COMPAT" not in engine_env(s)


def test_single_server_has_no_disaggregation_flags():
    argv = server_argv(ClusterSpec.load("cpu"), "/m", "single", 5)
    assert not any(a.startswith("--disaggregation") for a in argv)


@pytest.mark.parametrize("router,flag", [("sglang-router", False), ("mini-lb", True)])
def test_router_selection(router, flag):
    argv = router_argv(ClusterSpec.load("cpu", router=router), "http://127.0.0.1:1", 2, "http://127.0.0.1:3", 4)
    assert ("--mini-lb" in argv) is flag
    assert argv[argv.index("--prefill") + 1:argv.index("--prefill") + 3] == ["http://127.0.0.1:1", "2"]
    with_metrics = router_argv(ClusterSpec.load("cpu", router=router), "http://127.0.0.1:1", 2, "http://127.0.0.1:3", 4, 5)
    assert ("--prometheus-port" in with_metrics) is (not flag)  # no fixed 29000: two clusters coexist


def test_engine_env_loads_boot_dir_and_compat():
    env = engine_env(ClusterSpec.load("cpu"))
    assert env["PYTHONPATH"].split(":")[0].endswith("kvchaos/_boot")
    assert env["KVCHAOS_CPU_COMPAT"] == "1" and env["MC_FORCE_TCP"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "KVCHAOS_OWNER" not in env


@pytest.mark.parametrize("override,needle", [
    ({"transfer_backend": "rdma"}, "transfer_backend='rdma' not one of"),
    ({"router": "nginx"}, "router='nginx'"),
    ({"pool_tokens": 0}, "pool_tokens=0 must be >= 1"),
    ({"pool_tokens": 100, "page_size": 64}, "multiple of page_size"),
    ({"transfer_backend": "mooncake"}, "needs device='cuda'"),
    ({"model": "tiny:abc"}, "seed after 'tiny:'"),
    ({"model": "/nonexistent/model"}, "neither 'tiny:<seed>', 'probe[:<kind>]' nor an existing model directory"),
    ({"device": "cuda"}, "cpu_compat=true only makes sense"),
])
def test_bad_values_name_the_problem(override, needle):
    with pytest.raises(SpecError, match=None) as e:
        ClusterSpec.load("cpu", **override)
    assert needle in str(e.value)


def test_unknown_key_and_bad_type_in_toml(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text('[cluster]\npool_tokenz = 5\n')
    with pytest.raises(SpecError, match=r"unknown key\(s\) \['pool_tokenz'\]"):
        ClusterSpec.load(p)
    p.write_text('[cluster]\npool_tokens = "big"\n')
    with pytest.raises(SpecError, match="pool_tokens='big' must be an integer"):
        ClusterSpec.load(p)
    p.write_text('[cluster\n')
    with pytest.raises(SpecError, match="invalid TOML"):
        ClusterSpec.load(p)


def test_unknown_profile_lists_available():
    with pytest.raises(SpecError, match=r"unknown profile 'nope'.*'cpu'.*'gpu'"):
        ClusterSpec.load("nope")


def test_attach_parse():
    from kvchaos.cluster import AttachedCluster

    c = AttachedCluster.parse("router=http://127.0.0.1:1/,prefill=http://127.0.0.1:2,decode=http://127.0.0.1:3")
    assert c.endpoints.router == "http://127.0.0.1:1" and c.endpoints.decode == "http://127.0.0.1:3"
    with pytest.raises(ValueError, match=r"missing \['decode'\]"):
        AttachedCluster.parse("router=http://a:1,prefill=http://a:2")
    with pytest.raises(ValueError, match="unknown role 'lb'"):
        AttachedCluster.parse("lb=http://a:1")
    with pytest.raises(ValueError, match="must be an http"):
        AttachedCluster.parse("router=a:1,prefill=http://a:2,decode=http://a:3")
    assert c.agent_urls == {} and c.agent_token is None


def test_attach_with_agent_gateways_needs_their_token():
    """Attached engines that load the agent over TCP: the harness gets every agent fault through the
    gateways (faults.FaultKit over AgentClient.for_cluster), given the token they were started with."""
    from faults.client import AgentClient
    from kvchaos.cluster import AttachedCluster

    base = "router=http://r:1,prefill=http://p:2,decode=http://d:3"
    c = AttachedCluster.parse(base + ",prefill_agent=tcp://10.0.0.2:7810,decode_agent=tcp://10.0.0.3:7810",
                              env={"KVCHAOS_AGENT_TOKEN": "t0k"})
    assert c.agent_urls == {"prefill": "tcp://10.0.0.2:7810", "decode": "tcp://10.0.0.3:7810"}
    ctl = AgentClient.for_cluster(c)
    assert ctl.dir is None and sorted(ctl.remote) == ["decode", "prefill"]
    assert c.describe()["agent_urls"] == c.agent_urls and "t0k" not in str(c.describe())
    with pytest.raises(ValueError, match="KVCHAOS_AGENT_TOKEN is not set"):
        AttachedCluster.parse(base + ",decode_agent=tcp://10.0.0.3:7810", env={})
    for bad in ("decode_agent=http://d:7810", "decode_agent=tcp://d", "decode_agent=tcp://d:x"):
        with pytest.raises(ValueError, match="must be tcp://HOST:PORT"):
            AttachedCluster.parse(f"{base},{bad}", env={"KVCHAOS_AGENT_TOKEN": "t"})


def test_topology_and_agent_channel_are_checked():
    s = ClusterSpec.load("cpu", topology="two-hosts", agent_channel="tcp")
    assert (s.topology, s.agent_channel) == ("two-hosts", "tcp")
    with pytest.raises(SpecError, match="topology='three-hosts': use 'one-host' or 'two-hosts'"):
        ClusterSpec.load("cpu", topology="three-hosts")
    with pytest.raises(SpecError, match="agent_channel='http': use 'unix'"):
        ClusterSpec.load("cpu", agent_channel="http")


def test_the_router_health_check_waits_at_the_clusters_pace_unless_the_profile_says():
    """sglang-router takes a worker out after 3 health checks time out (5 s each): a busy like: probe on
    CPU missed them and every request got 503 (docs/reference/layouts-and-backends.md)."""
    def tail(**kw):
        return router_argv(ClusterSpec.load("cpu", **kw), "http://127.0.0.1:1", 2, "http://127.0.0.1:3", 4)
    assert "--health-check-timeout-secs" not in tail()
    argv = tail(pace=16.0)
    assert argv[argv.index("--health-check-timeout-secs") + 1] == "80"
    own = tail(pace=16.0, router_args=["--health-check-timeout-secs", "7"])
    assert own.count("--health-check-timeout-secs") == 1 and own[-1] == "7"
    assert "--health-check-timeout-secs" not in tail(pace=16.0, router="mini-lb")
