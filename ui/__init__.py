"""Gradio UI at "/": a minimal streaming chat over the in-process engine (the full UI is its own issue)."""
from __future__ import annotations

import gradio as gr

from engine import EngineHandle, EngineError, SamplingParams


def build_ui(handle: EngineHandle) -> gr.Blocks:
    async def chat(message: str, history: list[dict], temperature: float, max_tokens: int):
        engine = handle.engine
        if engine is None:
            yield "The model is still loading; try again in a few seconds."
            return
        messages = [{"role": m["role"], "content": _text(m["content"])} for m in history]
        messages.append({"role": "user", "content": message})
        try:
            prompt = engine.tokenizer.render_chat(messages)
            prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
            stream = engine.submit(prompt_ids, SamplingParams(temperature=temperature, max_tokens=int(max_tokens)))
        except EngineError as exc:
            yield f"⚠️ {exc.message}"
            return
        reply = ""
        try:
            async for out in stream:
                reply += out.text
                yield reply
        finally:
            if not stream.finished:  # Stop pressed or the browser went away
                engine.abort(stream.request_id)

    with gr.Blocks(title="Tern") as blocks:
        gr.Markdown("# Tern\nChat with the served model. The OpenAI-compatible API is at `/v1`.")
        temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature", render=False)
        max_tokens = gr.Slider(1, 2048, value=256, step=1, label="Max tokens", render=False)
        gr.ChatInterface(
            chat,
            additional_inputs=[temperature, max_tokens],
            concurrency_limit=None,  # the engine batches concurrent users itself
        )
    return blocks


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content)
