"""The app factory: settings and an engine handle -> the FastAPI app (its lifespan loads and stops the engine), with
the /v1 routers and the Gradio UI mounted at "/". app.py serves it under uvicorn, deploy/replica.py once per replica."""
from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager

from engine import Engine, EngineConfig, EngineHandle, ModelLoadError
from tern.settings import ServerSettings

logger = logging.getLogger("tern")


def create_app(server: ServerSettings | None = None, engine_config: EngineConfig | None = None,
               handle: EngineHandle | None = None):
    """The FastAPI app; /health says 503 until the engine has loaded. `handle`: one whose engine is already loading
    (main starts it first, so the weights load while the web app is imported and built); without one the app's
    lifespan starts loading it."""
    from fastapi import FastAPI

    from api import APICORSMiddleware, BodySizeLimitMiddleware, RequestIDMiddleware, build_router, install_error_handlers
    from ui import LOGIN_MESSAGE, build_ui, key_login  # before Gradio: ui imports it without its stub writing

    import gradio as gr

    server = server or ServerSettings()
    engine_config = engine_config or EngineConfig.serving()
    is_loading = handle is not None
    handle = handle or EngineHandle(server.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not is_loading:
            start_loading(handle, engine_config)
        try:
            yield
        finally:
            if handle.engine is not None:
                handle.engine.stop()

    app = FastAPI(title="Tern", version="0.1.0", lifespan=lifespan)
    app.state.handle = handle
    install_error_handlers(app)
    # The last added runs first: CORS headers reach every API answer (a 401 or 413 too), each with its request id.
    app.add_middleware(BodySizeLimitMiddleware, max_body_size_bytes=server.max_body_size_bytes)
    app.add_middleware(RequestIDMiddleware)  # every response, the UI's too, carries X-Request-ID
    if server.cors_origins:
        app.add_middleware(APICORSMiddleware, origins=list(server.cors_origins))
    router = build_router(handle, api_key=server.api_key, max_stored_responses=server.max_stored_responses)
    app.state.metrics = router.metrics
    app.include_router(router)
    # Mounted last: a mount at "/" catches every path not matched above. With an API key the UI asks for it too:
    # Gradio's own HTTP API (what gradio_client calls) runs the model as /v1 does.
    login = key_login(server.api_key) if server.api_key else None
    return gr.mount_gradio_app(app, build_ui(handle), path="/", auth=login, auth_message=LOGIN_MESSAGE if login else None)


def start_loading(handle: EngineHandle, config: EngineConfig) -> threading.Thread:
    """Load and start the engine on a thread of its own; the handle says ready once it serves (or why it failed).
    A daemon: stopping the server while the model loads does not wait for the load to end."""
    thread = threading.Thread(target=_load_engine, args=(handle, config), name="tern-load", daemon=True)
    thread.start()
    return thread


def _load_engine(handle: EngineHandle, config: EngineConfig) -> None:
    try:
        engine = Engine(config).start()
        if engine.info().decode_step == "compiling":
            # Ready means full speed: until the compiled step is built the eager one would serve at a fifth of its
            # speed, with the compile taking the cores from it, so /health says 503 until it is done.
            logger.info("building the compiled decode step before serving (seconds when the inductor cache has it, "
                        "minutes on a machine's first start)")
            engine.wait_for_compiled_decode()
        handle.set_engine(engine)
    except ModelLoadError as exc:
        logger.error("model failed to load: %s", exc.message)
        handle.set_error(exc.message)
    except Exception as exc:  # keep serving /health with the reason rather than dying silently
        logger.exception("model failed to load")
        handle.set_error(f"{type(exc).__name__}: {exc}")
