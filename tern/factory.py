"""The app factory: settings and a ModelRegistry -> the FastAPI app (its lifespan starts and stops the registry, which
loads and unloads the engines), with the /v1 routers and the Gradio UI mounted at "/" (built on its first visit:
tern/lazy_ui.py). app.py serves it under uvicorn, deploy/replica.py once per replica."""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from engine import EngineConfig
from engine.registry import ModelRegistry, ModelSpec
from engine.weights.checkpoint import model_name
from tern.lazy_ui import LazyUI
from tern.settings import ServerSettings

logger = logging.getLogger("tern")


def create_app(server: ServerSettings | None = None, engine_config: EngineConfig | None = None,
               registry: ModelRegistry | None = None):
    """The FastAPI app; /health says 503 until the first model has loaded. `registry`: one already started (main
    starts it first, so the weights load while the web app is imported and built); without one the app serves
    `engine_config`'s model alone, loaded at start by the app's lifespan."""
    from fastapi import FastAPI

    from api import APICORSMiddleware, BodySizeLimitMiddleware, RequestIDMiddleware, build_router, install_error_handlers

    server = server or ServerSettings()
    is_started = registry is not None
    if registry is None:
        engine_config = engine_config or EngineConfig.serving()
        model_id = server.served_model_name or model_name(engine_config.model)
        registry = ModelRegistry([ModelSpec(model_id, engine_config)])

    web_ui = LazyUI(lambda: build_web_ui(registry, server.api_key))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not is_started:
            registry.start(preload=[registry.default_id])
        try:
            yield
        finally:
            await web_ui.close()
            registry.stop()

    app = FastAPI(title="Tern", version="0.1.0", lifespan=lifespan)
    app.state.models = registry
    app.state.handle = registry.handle()  # the first model's: what a single-model caller (deploy/) waits on
    install_error_handlers(app)
    # The last added runs first: CORS headers reach every API answer (a 401 or 413 too), each with its request id.
    app.add_middleware(BodySizeLimitMiddleware, max_body_size_bytes=server.max_body_size_bytes)
    app.add_middleware(RequestIDMiddleware)  # every response, the UI's too, carries X-Request-ID
    if server.cors_origins:
        app.add_middleware(APICORSMiddleware, origins=list(server.cors_origins))
    router = build_router(registry, api_key=server.api_key, max_stored_responses=server.max_stored_responses)
    app.state.metrics = router.metrics
    app.include_router(router)
    app.mount("/", web_ui)  # last: a mount at "/" catches every path not matched above
    return app


def build_web_ui(registry: ModelRegistry, api_key: str | None):
    """The Gradio UI mounted at "/" of a FastAPI app of its own, whose lifespan starts Gradio's queue (LazyUI runs
    it). With an API key the UI asks for it too: Gradio's own HTTP API (what gradio_client calls) runs the model as
    /v1 does."""
    from fastapi import FastAPI

    from ui import LOGIN_MESSAGE, build_ui, key_login  # before Gradio: ui imports it without its stub writing

    import gradio as gr

    login = key_login(api_key) if api_key else None
    return gr.mount_gradio_app(FastAPI(), build_ui(registry), path="/", auth=login,
                               auth_message=LOGIN_MESSAGE if login else None)
