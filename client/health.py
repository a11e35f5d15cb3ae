"""`python -m client.health`: the deep health check for probes (Kubernetes exec probes, load balancers, scripts).

Calls the `health` model (backends/mm_health) and exits 0 when healthy, 1 when a check failed (the report names
it), 2 when the server did not answer within the timeout. Prints the report as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def check(url: str, model: str = "health", timeout_s: float = 5.0) -> dict:
    """The `health` model's report over HTTP; raises tritonclient's InferenceServerException when it cannot."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
    try:
        result = client.infer(model, [], outputs=[httpclient.InferRequestedOutput("status")])
        return json.loads(result.as_numpy("status").reshape(-1)[0])
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.health", description=__doc__)
    parser.add_argument("--url", default=f"localhost:{os.environ.get('HTTP_PORT', 8000)}", help="HTTP host:port")
    parser.add_argument("--model", default="health")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds")
    args = parser.parse_args(argv)
    from tritonclient.utils import InferenceServerException

    try:
        status = check(args.url, args.model, args.timeout)
    except (InferenceServerException, OSError) as e:
        print(json.dumps({"healthy": False, "error": str(e)}))
        return 2
    print(json.dumps(status))
    return 0 if status["healthy"] else 1


if __name__ == "__main__":
    sys.exit(main())
