"""Tern: one process serving the OpenAI-compatible API at /v1 and the Gradio UI at /, over one engine.

The entry point only: settings (tern/settings.py: every flag and its TERN_* environment variable) -> the checkpoint
resolved -> EngineHandle (the engine loads on a thread from here on) -> the app (tern/factory.py) under uvicorn.
"""
from __future__ import annotations

import logging
import sys

from api.shutdown import FLUSH_TIMEOUT_S, DrainingServer
from engine import EngineHandle, ModelLoadError
from tern.factory import create_app, start_loading
from tern.settings import parse_args

logger = logging.getLogger("tern")


def main(argv: list[str] | None = None) -> int:
    server, engine_config, prepare_only = parse_args(argv)
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine import kernels
    from engine.weights import checkpoint

    cache_dir = engine_config.cache_path
    if engine_config.device != "cuda":
        kernels.prebuild(cache_dir)  # a first start compiles them while it converts the model
    # Resolve (and on first start, convert) the checkpoint before serving, so a bad --model is one clear line.
    try:
        folder, _ = checkpoint.resolve_checkpoint(engine_config.model, cache_dir)
    except ModelLoadError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if prepare_only:
        kernels.select(cache_dir)  # built now, so a container's first start does not compile them
        logger.info("model ready at %s", folder)
        return 0

    # Loading is mostly C++ and file reads, building the web app (importing Gradio, FastAPI and the UI) is Python:
    # started first, the weights load while the app is built, instead of after it.
    handle = EngineHandle(server.served_model_name)
    start_loading(handle, engine_config)
    import uvicorn

    app = create_app(server, engine_config, handle)
    # h11 and asyncio whatever else is installed: uvicorn's "auto" picks httptools and uvloop when present (Ray
    # brings them, requirements-ray.txt), and the server would then parse and schedule differently from the image.
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level,
                            timeout_graceful_shutdown=FLUSH_TIMEOUT_S, http="h11", loop="asyncio")
    DrainingServer(config, app.state.handle, server.drain_timeout_s).run()  # returns once drained
    return 0


if __name__ == "__main__":
    sys.exit(main())
