"""Launch, attach to and supervise SGLang prefill/decode clusters."""

from .launcher import AttachedCluster, Cluster, ClusterStartError, Endpoints, SingleServer
from .procs import ProcessDied
from .spec import ClusterSpec, SpecError

__all__ = ["AttachedCluster", "Cluster", "ClusterSpec", "ClusterStartError", "Endpoints",
           "ProcessDied", "SingleServer", "SpecError"]
