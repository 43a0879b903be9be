"""Tern: one process serving the OpenAI-compatible API at /v1 and the Gradio UI at /, over one engine per model.

The entry point only: settings (tern/settings.py: every flag and its TERN_* environment variable; the models from
--model or --models, tern/model_specs.py) -> the checkpoints checked -> the ModelRegistry (the first model loads on a
thread from here on) -> the app (tern/factory.py) under uvicorn.
"""
from __future__ import annotations

import gc
import os

if __name__ == "__main__":
    # Started as a server: no cyclic collection until the app is built (see end_startup_gc_pause). Here, before the
    # imports, which are most of the objects a start creates.
    gc.disable()
    from tern.allocator_env import allocator_env  # before torch's import, which reads it (huge pages)

    os.environ.update(allocator_env())

import logging
import sys
from pathlib import Path

from api.shutdown import FLUSH_TIMEOUT_S, DrainingServer
from engine import ModelLoadError
from engine.registry import ModelRegistry, ModelSpec
from tern.factory import create_app
from tern.settings import SettingsError, parse_args

logger = logging.getLogger("tern")


def main(argv: list[str] | None = None) -> int:
    try:
        server, specs, prepare_only = parse_args(argv)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine import kernels

    cache_dir = specs[0].config.cache_path
    if any(spec.config.device != "cuda" for spec in specs):
        kernels.prebuild(cache_dir)  # a first start compiles them while it converts the model
    try:
        check_checkpoints(specs, convert=prepare_only or len(specs) == 1)
    except ModelLoadError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if prepare_only:
        kernels.select(cache_dir)  # built now, so a container's first start does not compile them
        logger.info("%s ready", ", ".join(f"`{spec.id}`" for spec in specs))
        return 0

    # Loading is mostly C++ and file reads, building the web app (FastAPI and the API's routes; the UI is built on
    # its first visit, tern/lazy_ui.py) is Python: started first, the first model's weights load while the app is
    # built, instead of after it. The others load when a request first names them.
    registry = ModelRegistry(specs, max_loaded=server.max_loaded if len(specs) > 1 else None)
    registry.start(preload=[registry.default_id])
    import uvicorn

    app = create_app(server, registry=registry)
    end_startup_gc_pause()
    # h11 and asyncio whatever else is installed: uvicorn's "auto" picks httptools and uvloop when present (Ray
    # brings them, requirements-ray.txt), and the server would then parse and schedule differently from the image.
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level,
                            timeout_graceful_shutdown=FLUSH_TIMEOUT_S, http="h11", loop="asyncio")
    DrainingServer(config, registry, server.drain_timeout_s).run()  # returns once drained
    return 0


def end_startup_gc_pause() -> None:
    """A start creates the web app's objects (FastAPI, pydantic, transformers; Gradio's wait for the UI's first
    visit) and few cycles among them, yet with the collector on Python traversed them all, again and again as they
    grew: 6 full collections, 0.6 s of a 1B GGUF's start on 2 cores, holding the GIL. Started as a server,
    collection is off until here; now those objects move to the permanent generation (gc.freeze: later collections
    skip them) and collection is back on for what serving creates. Called by a caller that kept the collector on
    (tests), nothing changes."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def check_checkpoints(specs: list[ModelSpec], convert: bool) -> None:
    """Before serving, so a bad model is one clear line rather than a server that cannot serve it. convert (one
    model, or --prepare-only): resolve each checkpoint, converting it on a first start, as a single-model server
    always has. Several models: only check that each local path exists; one that exists but does not load fails
    when first asked for, with its reason, and the others serve on."""
    from engine.weights import checkpoint

    for spec in specs:
        if convert:
            checkpoint.resolve_checkpoint(spec.config.model, spec.config.cache_path)
            continue
        model = spec.config.model
        looks_local = model is not None and (model.startswith((".", "/", "~")) or model.endswith(".gguf"))
        if looks_local and not Path(model).expanduser().exists():
            raise ModelLoadError(f"model `{spec.id}`: {model} does not exist")


if __name__ == "__main__":
    sys.exit(main())
