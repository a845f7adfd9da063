"""Launch, attach to and supervise SGLang prefill/decode clusters."""

from .hooks import NetworkProxy, ProxyFactory, default_proxy_factory, set_default_proxy_factory
from .launcher import AttachedCluster, Cluster, ClusterStartError, Endpoints, ProxyFactoryMissing, SingleServer
from .procs import ProcessDied
from .spec import ClusterSpec, SpecError

__all__ = ["AttachedCluster", "Cluster", "ClusterSpec", "ClusterStartError", "Endpoints", "NetworkProxy",
           "ProcessDied", "ProxyFactory", "ProxyFactoryMissing", "SingleServer", "SpecError",
           "default_proxy_factory", "set_default_proxy_factory"]
