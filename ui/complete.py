"""Complete tab: a raw prompt with no chat template (base-model style), streamed, with an optional logprobs view."""
from __future__ import annotations

from functools import partial

import gradio as gr

from engine import FINISH_ABORT, EngineError
from engine.registry import ModelRegistry
from ui.feedback import report_error
from ui.models import build_model_picker, lease_model, loading_message, needs_loading
from ui.sampling import build_sampling_controls, sampling_params
from ui.tokens import render_tokens_html, token_views

EXAMPLE_PROMPT = "The three primary colours are"


async def complete_text(
    registry: ModelRegistry,
    prompt: str,
    show_logprobs: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    max_tokens: int,
    seed: str | None,
    stop: str,
    model: str | None = None,
):
    """Stream the continuation of `prompt` exactly as typed, on `model` (loaded first if it is not). Yields
    (completion, tokens_html, status). Holds a lease on the model until it ends, however it ends."""
    try:
        params = sampling_params(temperature, top_p, top_k, max_tokens, seed, stop)
        if needs_loading(registry, model):
            yield "", "", loading_message(registry.resolve(model))
        lease = await lease_model(registry, model)
    except EngineError as exc:
        yield "", "", report_error(exc)
        return
    try:
        engine = lease.engine
        stream = engine.submit(prompt, params)  # a str is encoded with the tokenizer's BOS, like /v1/completions
    except EngineError as exc:
        lease.release()
        yield "", "", report_error(exc)
        return
    text, tokens = "", []
    try:
        async for out in stream:
            text += out.text
            tokens += token_views(out.logprobs or [], engine.tokenizer.token_text, engine.tokenizer.eos_ids)
            status = _status(out.num_prompt_tokens, out.num_output_tokens, out.finish_reason, out.stop_reason)
            yield text, render_tokens_html(tokens) if show_logprobs else "", status
    except Exception as exc:  # a failure delivered mid-stream
        yield text, render_tokens_html(tokens) if show_logprobs else "", report_error(exc)
    finally:
        stream.close()  # Stop pressed or the tab closed: the engine frees its KV blocks now
        lease.release()  # and the model may be unloaded again once idle


def build_complete_tab(registry: ModelRegistry) -> None:
    """Lay out the Complete tab and wire its events (inside a gr.Blocks context)."""
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=320):
            model = build_model_picker(registry, "complete-model")
            prompt = gr.Textbox(
                label="Prompt", value=EXAMPLE_PROMPT, lines=6, max_lines=20, elem_id="complete-prompt",
                info="sent as typed: no chat template, so the model simply continues the text",
            )
            with gr.Row():
                generate = gr.Button("Generate", variant="primary", elem_id="complete-generate", min_width=100)
                stop = gr.Button("Stop", variant="stop", elem_id="complete-stop", min_width=80)
            completion = gr.Textbox(label="Completion", lines=6, max_lines=30, interactive=False,
                                    buttons=["copy"], elem_id="complete-output")
            status = gr.Markdown(elem_id="complete-status")
            tokens_html = gr.HTML(elem_id="complete-tokens")
        with gr.Column(scale=2, min_width=280):
            show_logprobs = gr.Checkbox(label="Show token probabilities", elem_id="complete-show-probs",
                                        info="colour each token; hover or tap one for the top alternatives")
            controls = build_sampling_controls(
                "complete", default_max_tokens=64, default_temperature=0.0, default_top_p=1.0
            )

    # The model last: a Gradio API call written for one model (no model argument) still means the same.
    inputs = [prompt, show_logprobs, *controls.inputs, model]
    outputs = [completion, tokens_html, status]
    run = partial(complete_text, registry)
    event = generate.click(run, inputs, outputs, concurrency_limit=None, show_progress="minimal")
    stop.click(None, cancels=[event])


def _status(num_prompt_tokens: int, num_output_tokens: int, finish_reason: str | None, stop_reason) -> str:
    """One line under the output: token counts and, once done, why it ended."""
    counts = f"{num_prompt_tokens} prompt tokens \u00b7 {num_output_tokens} generated"
    if finish_reason is None:
        return f"{counts} \u00b7 generating\u2026"
    why = {"length": "hit the max tokens limit", "stop": "the model ended the text",
           FINISH_ABORT: "cut short, the server is shutting down"}.get(finish_reason, finish_reason)
    if isinstance(stop_reason, str):
        why = f"reached the stop sequence {stop_reason!r}"
    return f"{counts} \u00b7 finished: {why}"
