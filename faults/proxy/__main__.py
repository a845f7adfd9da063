"""``python -m faults.proxy --port 8474``: the proxy API server alone, on this process's loop."""

from .server import main

if __name__ == "__main__":
    main()
