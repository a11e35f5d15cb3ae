"""`python -m frontend` (`make openai`): the OpenAI-compatible API on OPENAI_PORT (9000), reaching tritonserver's gRPC
endpoint on GRPC_PORT (8001) of this host."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m frontend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    parser.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)))
    parser.add_argument("--triton", default=f"localhost:{os.environ.get('GRPC_PORT', 8001)}", help="gRPC endpoint")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"),
                        help="where the models' tokenizers are (chat templates, token counts)")
    parser.add_argument("--default-max-tokens", type=int, default=512, help="when a request sets none")
    parser.add_argument("--max-body-mb", type=float, default=32, help="larger requests are refused (413)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes serving the port (uvicorn workers): one event loop parses every stream's "
                        "tokens, so many concurrent streams need several")
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "auto"], default="asyncio",
                        help="the event loop (uvicorn's): asyncio's own by default, where gRPC's asyncio client, which "
                        "receives the tokens, streamed faster than under uvloop (README)")
    args = parser.parse_args(argv)
    import uvicorn

    os.environ[SETTINGS_ENV] = json.dumps([args.triton, str(args.repository), args.default_max_tokens,
                                           args.max_body_mb])  # for each worker's app_from_environment
    uvicorn.run("frontend.__main__:app_from_environment", factory=True, host=args.host, port=args.port,
                workers=args.workers, loop=args.loop, log_level="info")
    return 0


SETTINGS_ENV = "TRITON_MULTIMODAL_FRONTEND"


def app_from_environment():
    """The app of one worker process, from the settings `main` put in the environment."""
    from frontend.app import create_app

    triton, repository, default_max_tokens, max_body_mb = json.loads(os.environ[SETTINGS_ENV])
    return create_app(triton, Path(repository), default_max_tokens, max_body_mb)


if __name__ == "__main__":
    sys.exit(main())
