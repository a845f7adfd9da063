"""Launch, attach to and supervise SGLang prefill/decode clusters."""

from .api import AgentMissing, ClusterStartError, Endpoints, ProxyFactoryMissing
from .attached import AttachedCluster
from .hooks import (
    NetworkProxy,
    ProxyFactory,
    default_proxy_factory,
    engine_agent,
    set_default_proxy_factory,
    set_engine_agent,
)
from .launcher import Cluster
from .procs import ProcessDied
from .single import SingleServer
from .spec import ClusterSpec, SpecError

__all__ = ["AgentMissing", "AttachedCluster", "Cluster", "ClusterSpec", "ClusterStartError", "Endpoints",
           "NetworkProxy", "ProcessDied", "ProxyFactory", "ProxyFactoryMissing", "SingleServer", "SpecError",
           "default_proxy_factory", "engine_agent", "set_default_proxy_factory", "set_engine_agent"]
