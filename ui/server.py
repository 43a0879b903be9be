"""Server tab: every served model with its state, what the picked one is, its live engine load (refreshed by a
gr.Timer) and a ready-to-copy openai SDK snippet."""
from __future__ import annotations

from functools import partial

import gradio as gr

from engine import EngineHandle, EngineInfo
from engine.registry import FAILED, ModelRegistry
from ui.models import STATE_TEXT, STATUS_HEADERS, build_model_picker, status_rows

REFRESH_S = 2.0


def describe_model(registry: ModelRegistry) -> str:
    """The one-paragraph header at the top of the page: the default model, and the others when there are several."""
    handle = registry.handle()
    engine = handle.engine
    others = ""
    if len(registry.ids) > 1:
        names = ", ".join(f"`{model_id}`" for model_id in registry.ids)
        others = (f" This server serves {len(registry.ids)} models ({names}): pick one on each tab, or **Compare** "
                  "two side by side.")
    if engine is None:
        state = registry.status().state
        if state != FAILED:
            text = STATE_TEXT.get(state, state).capitalize()
            end = "" if text.endswith("\u2026") else "."
            return f"# Tern \u00b7 {registry.default_id}\n{text}{end}{others}"
        return f"# Tern\nfailed to load: {handle.error}{others}"
    info = engine.info()
    kind = "an instruction-tuned chat model" if info.has_chat_template else "a base model (no chat template)"
    return (
        f"# Tern \u00b7 {registry.default_id}\n"
        f"{format_count(info.num_parameters)} parameters, {kind}, running {info.dtype} on "
        f"{info.device}, with a {info.max_model_len:,}-token context. **Chat** with it, **Complete** raw text, "
        f"**Score** continuations by likelihood, or call the OpenAI-compatible API at `/v1` (see **Server**).{others}"
    )


def model_facts(registry: ModelRegistry, model: str | None = None) -> list[list[str]]:
    """Rows (fact, value) describing one served model: what it is when loaded, else its state."""
    status = registry.status(model)
    engine = registry.handle(model).engine
    if engine is None:
        state = f"failed: {status.error}" if status.state == FAILED else STATE_TEXT.get(status.state, status.state)
        return [["Model id", status.id], ["Status", state]]
    info = engine.info()
    weight_bytes, kv_bytes = info.weight_bytes, info.kv_cache_bytes
    return [
        ["Model id", status.id],
        ["Parameters", f"{format_count(info.num_parameters)} ({info.num_parameters:,})"],
        ["Dtype", info.dtype],
        ["Quantization", info.weights],
        ["Device", info.device],
        ["Decode step", _decode_step(info)],
        ["CPU kernels", info.cpu_kernels],
        ["Memory", f"{format_bytes(weight_bytes + kv_bytes)} ({format_bytes(weight_bytes)} weights + "
                   f"{format_bytes(kv_bytes)} KV cache in {info.kv_cache_dtype})" if kv_bytes else
                   f"{format_bytes(weight_bytes)} weights (no KV cache: every step recomputes the sequence)"],
        ["Max context", f"{info.max_model_len:,} tokens"],
        ["Max concurrent sequences", str(info.max_num_seqs)],
    ]


def _decode_step(info: EngineInfo) -> str:
    kind = {"native": "native (Tern's C++ step, all layers in one call)", "compiled": "compiled (torch.compile)",
            "compiling": "eager, while the compiled step builds in the background"}.get(info.decode_step, "eager")
    return f"{kind}, replayed from CUDA graphs" if info.decode_graphs else kind


def live_stats(handle: EngineHandle) -> list[list[str]]:
    """Rows (metric, value) of the engine's load right now."""
    engine = handle.engine
    if engine is None:
        return [["Engine", "not running yet"]]
    stats = engine.stats()
    return [
        ["Running requests", str(stats.num_running)],
        ["Waiting requests", str(stats.num_waiting)],
        ["KV cache in use", f"{100 * stats.kv_cache_usage:.1f}% ({stats.num_kv_blocks_used} of "
                            f"{stats.num_kv_blocks_used + stats.num_kv_blocks_free} blocks)"],
        ["Generated tokens/s (last 5 s)", f"{stats.tokens_per_s:.1f}"],
        ["Preemptions", str(stats.num_preemptions)],
    ]


def base_url(request: gr.Request | None) -> str:
    """This server's /v1 address as the browser reached it (behind a proxy: X-Forwarded-Proto / -Host)."""
    headers = request.headers if request is not None else {}
    host = _first(headers.get("x-forwarded-host")) or headers.get("host") or "127.0.0.1:7860"
    scheme = _first(headers.get("x-forwarded-proto"))
    if not scheme:
        scheme = request.request.url.scheme if request is not None and request.request is not None else "http"
    return f"{scheme}://{host}/v1"


def openai_snippet(model_id: str, request: gr.Request | None) -> str:
    """Python that talks to this server with the official openai SDK."""
    return (
        "from openai import OpenAI\n\n"
        f'client = OpenAI(base_url="{base_url(request)}", api_key="none")  # or your TERN_API_KEY\n'
        "reply = client.chat.completions.create(\n"
        f'    model="{model_id}",\n'
        '    messages=[{"role": "user", "content": "What is the capital of France?"}],\n'
        ")\n"
        "print(reply.choices[0].message.content)\n"
    )


def format_count(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def format_bytes(size_bytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= size:
            return f"{size_bytes / size:.1f} {unit}"
    return f"{size_bytes} B"


def build_server_tab(registry: ModelRegistry, blocks: gr.Blocks) -> None:
    """Lay out the Server tab and wire its refreshes (inside `blocks`' context)."""
    models = gr.Dataframe(status_rows(registry.statuses()), headers=STATUS_HEADERS, interactive=False,
                          elem_id="server-models", label="Served models", visible=len(registry.ids) > 1)
    model = build_model_picker(registry, "server-model-picker", label="Details of")
    with gr.Row(equal_height=False):
        with gr.Column(min_width=300):
            facts = gr.Dataframe(model_facts(registry), headers=["Model", ""], interactive=False,
                                 elem_id="server-model", show_label=False)
        with gr.Column(min_width=300):
            stats = gr.Dataframe(live_stats(registry.handle()), headers=[f"Engine load (every {REFRESH_S:g} s)", ""],
                                 interactive=False, elem_id="server-stats", show_label=False)
    snippet = gr.Code(language="python", label="Use this server from Python (pip install openai)",
                      elem_id="server-snippet", interactive=False)

    def show_snippet(model_id: str, request: gr.Request) -> str:
        return openai_snippet(registry.resolve(model_id), request)

    timer = gr.Timer(REFRESH_S)
    refresh = partial(refresh_server_tab, registry)
    timer.tick(refresh, model, [models, facts, stats], show_progress="hidden", queue=False)
    blocks.load(refresh, model, [models, facts, stats], queue=False)
    model.change(refresh, model, [models, facts, stats], queue=False)
    blocks.load(show_snippet, model, snippet, queue=False)
    model.change(show_snippet, model, snippet, queue=False)


def refresh_server_tab(registry: ModelRegistry, model: str | None) -> tuple[list[list[str]], ...]:
    """(every model's state, the picked model's facts, its engine's load). Reads only: showing a model never loads
    it or keeps it loaded."""
    return status_rows(registry.statuses()), model_facts(registry, model), live_stats(registry.handle(model))


def _first(value: str | None) -> str:
    """The first entry of a comma-separated forwarded header (one per proxy hop)."""
    return value.split(",")[0].strip() if value else ""

