"""kvchaos: chaos and fault injection for disaggregated (prefill/decode) LLM inference."""

from pathlib import Path

# the known engine findings and the engine errors they name: data, read by the policy
# (kvchaos.policy.findings) and by the cluster's log scan (kvchaos.cluster.engine_errors)
FINDINGS_FILE = Path(__file__).resolve().parent / "findings.toml"
