"""`python -m frontend` (`make openai`): the OpenAI-compatible API on OPENAI_PORT (9000), reaching tritonserver's gRPC
endpoint on GRPC_PORT (8001) of this host."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)))
    parser.add_argument("--triton", default=f"localhost:{os.environ.get('GRPC_PORT', 8001)}", help="gRPC endpoint")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"),
                        help="where the models' tokenizers are (chat templates, token counts)")
    parser.add_argument("--default-max-tokens", type=int, default=512, help="when a request sets none")
    parser.add_argument("--max-body-mb", type=float, default=32, help="larger requests are refused (413)")
    args = parser.parse_args(argv)
    import uvicorn

    from frontend.app import create_app

    uvicorn.run(create_app(args.triton, args.repository, args.default_max_tokens, args.max_body_mb),
                host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
