"""Compare tab: one prompt (chat or completion), with the same sampling settings and seed, sent to two models at once;
both answers stream side by side as coloured tokens (probabilities on hover), each with its logprob total."""
from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import gradio as gr

from engine import FINISH_ABORT, EngineError, NoChatTemplateError, SamplingParams
from engine.registry import ModelRegistry
from ui.feedback import report_error
from ui.models import build_model_picker, lease_model, loading_message, needs_loading
from ui.sampling import build_sampling_controls, sampling_params
from ui.tokens import LEGEND_HTML, TokenView, render_tokens_html, token_views, total_logprob

CHAT, COMPLETION = "Chat", "Completion"
EXAMPLE_PROMPT = "What is the capital of France?"
MAX_SEED = 2**31 - 1


@dataclass
class Answer:
    """One side of the comparison as it streams: the model, its tokens so far and a status line."""

    model_id: str
    tokens: list[TokenView] = field(default_factory=list)
    status: str = ""
    finish_reason: str | None = None

    @property
    def total_logprob(self) -> float:
        return total_logprob(self.tokens)


async def compare_models(
    registry: ModelRegistry,
    model_a: str | None,
    model_b: str | None,
    mode: str,
    prompt: str,
    system_prompt: str,
    temperature: float,
    top_p: float,
    top_k: int,
    max_tokens: int,
    seed: str | None,
    stop: str,
):
    """Stream both models' answers to one prompt, concurrently. Yields (tokens HTML A, status A, tokens HTML B,
    status B) whenever either side has news. A blank seed becomes one random seed, used by both sides (and shown).
    Each side leases its model while it runs; Stop or a closed tab cancels both, which aborts their requests and
    releases the leases."""
    try:
        params = sampling_params(temperature, top_p, top_k, max_tokens, seed, stop)
        if params.seed is None:  # "same seed" for both sides, and one a user can type to see these answers again
            params = dataclasses.replace(params, seed=random.randint(0, MAX_SEED))
        answers = [Answer(registry.resolve(model_a)), Answer(registry.resolve(model_b))]
        _check_room_for(registry, [answer.model_id for answer in answers])
    except EngineError as exc:
        message = report_error(exc)
        yield "", message, "", message
        return
    news = asyncio.Event()
    tasks = [asyncio.create_task(_run_answer(registry, answer, mode, prompt, system_prompt, params, news.set))
             for answer in answers]
    try:
        while True:
            await news.wait()
            news.clear()  # updates that arrive while this one is on its way are shown together in the next
            is_finished = all(task.done() for task in tasks)  # before the yield: the render then has both endings
            yield _render(answers, params.seed)
            if is_finished:
                return
    finally:
        for task in tasks:  # the user stopped or left: abort both requests; each task releases its lease
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def build_compare_tab(registry: ModelRegistry) -> None:
    """Lay out the Compare tab and wire its events (inside a gr.Blocks context)."""
    gr.Markdown("One prompt, two models, the same sampling settings and seed: both answers stream side by side. "
                "Each token is coloured by how likely its model found it (hover or tap one for the alternatives); "
                "the total under each answer is the sum of its tokens' logprobs.")
    ids = registry.ids
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=320):
            with gr.Row():
                model_a = build_model_picker(registry, "compare-model-a", label="Model A")
                model_b = build_model_picker(registry, "compare-model-b", label="Model B",
                                             value=ids[1] if len(ids) > 1 else ids[0])
            mode = gr.Radio([CHAT, COMPLETION], value=CHAT, label="Mode", elem_id="compare-mode",
                            info="Chat: the prompt is a user message in each model's chat template. "
                                 "Completion: sent as typed, the models continue it.")
            prompt = gr.Textbox(label="Prompt", value=EXAMPLE_PROMPT, lines=3, max_lines=12, elem_id="compare-prompt")
            with gr.Row():
                run = gr.Button("Compare", variant="primary", elem_id="compare-run", min_width=100)
                stop = gr.Button("Stop", variant="stop", elem_id="compare-stop", min_width=80)
        with gr.Column(scale=2, min_width=280):
            system_prompt = gr.Textbox(label="System prompt", lines=2, max_lines=8, elem_id="compare-system",
                                       placeholder="Optional, chat mode only")
            controls = build_sampling_controls("compare", default_max_tokens=64)
    with gr.Row(equal_height=False):
        outputs = []
        for side in ("a", "b"):
            with gr.Column(min_width=300, elem_id=f"compare-answer-{side}"):
                status = gr.Markdown(elem_id=f"compare-status-{side}")
                tokens_html = gr.HTML(elem_id=f"compare-tokens-{side}")
                outputs += [tokens_html, status]
    gr.HTML(LEGEND_HTML, elem_id="compare-legend")

    inputs = [model_a, model_b, mode, prompt, system_prompt, *controls.inputs]
    event = run.click(partial(compare_models, registry), inputs, outputs, concurrency_limit=None,
                      show_progress="minimal", api_name="compare")
    stop.click(None, cancels=[event])
    mode.change(lambda chosen: gr.update(visible=chosen == CHAT), mode, system_prompt, queue=False)


async def _run_answer(registry: ModelRegistry, answer: Answer, mode: str, prompt: str, system_prompt: str,
                      params: SamplingParams, notify: Callable[[], None]) -> None:
    """One side: lease its model (loading it if needed), stream its answer into `answer`, calling notify() on news."""
    try:
        if needs_loading(registry, answer.model_id):
            answer.status = loading_message(answer.model_id)
            notify()
        with await lease_model(registry, answer.model_id) as lease:
            engine = lease.engine
            stream = engine.submit(_prompt_for(engine, mode, prompt, system_prompt), params)
            try:
                answer.status = "generating\u2026"
                async for out in stream:
                    answer.tokens += token_views(out.logprobs or [], engine.tokenizer.token_text,
                                                 engine.tokenizer.eos_ids)
                    answer.finish_reason = out.finish_reason
                    notify()
            finally:
                stream.close()  # cancelled (Stop, the tab closed): the engine frees its KV blocks now
    except NoChatTemplateError:
        answer.status = report_error(EngineError(f"`{answer.model_id}` has no chat template: use Completion mode."))
    except Exception as exc:  # its own failure, shown on its side; the other side goes on
        answer.status = report_error(exc)
    finally:
        notify()


def _prompt_for(engine, mode: str, prompt: str, system_prompt: str) -> str | list[int]:
    """What the engine is sent: the text as typed, or a user message (after the system prompt) in its chat template."""
    if mode == COMPLETION:
        return prompt  # encoded with the tokenizer's BOS, like /v1/completions
    messages = [{"role": "system", "content": system_prompt}] if system_prompt and system_prompt.strip() else []
    text = engine.tokenizer.render_chat([*messages, {"role": "user", "content": prompt}])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _check_room_for(registry: ModelRegistry, model_ids: list[str]) -> None:
    """Both models stream at once, so both must be loaded at once: refuse at once where the server cannot, rather
    than wait forever for a room the first model's lease never frees."""
    if len(set(model_ids)) > 1 and registry.max_loaded is not None and registry.max_loaded < 2:
        raise EngineError(f"Compare runs two models at once, and this server keeps at most {registry.max_loaded} "
                          "loaded (--max-loaded): pick the same model twice, or ask for --max-loaded 2.")


def _render(answers: list[Answer], seed: int) -> tuple[str, str, str, str]:
    rendered = []
    for answer in answers:
        rendered += [render_tokens_html(answer.tokens, legend=False) if answer.tokens else "",
                     _status_line(answer, seed)]
    return tuple(rendered)


def _status_line(answer: Answer, seed: int) -> str:
    """`model` · N tokens · total logprob (and per token) · how it ended, or its loading/error line."""
    if answer.status and not answer.tokens and answer.finish_reason is None:
        return f"**{answer.model_id}** \u00b7 {answer.status}"
    count = len(answer.tokens)
    parts = [f"**{answer.model_id}**", f"{count} tokens"]
    if count:
        total = answer.total_logprob
        parts.append(f"total logprob **{total:.3f}** ({total / count:.3f} per token)")
    if answer.finish_reason is None:
        parts.append(answer.status or "generating\u2026")
    else:
        why = {"length": "hit the max tokens limit", "stop": "ended",
               FINISH_ABORT: "cut short, the server is shutting down"}.get(answer.finish_reason, answer.finish_reason)
        parts.append(f"{why} \u00b7 seed {seed}")
    return " \u00b7 ".join(parts)
