"""Fault injectors (in-engine agent, toxiproxy-compatible network proxy, request faults).

Not built yet: tracked by the "Fault injectors that provably fire" issue. The boot hook
(kvchaos/_boot/sitecustomize.py) already loads ``faults.agent`` into every engine process when
KVCHAOS_AGENT is set, once that module exists.
"""
