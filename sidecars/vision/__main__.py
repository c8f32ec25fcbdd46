"""``python -m sidecars.vision --checkpoint DIR --host 127.0.0.1 --port P`` (other settings: env).

The checkpoint is checked (config, index, shards, architecture) before the port opens, so a wrong folder exits
with status 2 and a message naming what is missing; the weights themselves load after, behind /health.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from .errors import CheckpointError


def parse(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m sidecars.vision", description=__doc__)
    parser.add_argument(
        "--checkpoint", type=Path, help="local checkpoint folder (WARMROUTE_VISION_CHECKPOINT)"
    )
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8490)")
    parser.add_argument("--threads", type=int, help="torch threads for the encoder (default 2)")
    args = vars(parser.parse_args(argv))
    return {k: v for k, v in args.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    import torch
    import uvicorn
    from pydantic import ValidationError

    from . import loader
    from .app import create_app
    from .settings import VisionSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = VisionSettings(**parse(sys.argv[1:] if argv is None else argv))
        loader.plan(settings.checkpoint)
    except ValidationError as exc:
        print(f"warmroute vision sidecar: bad settings: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"warmroute vision sidecar: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(settings.threads)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
