"""Chat tab: multi-turn streaming chat on the picked model with a system prompt, sampling controls, an optional JSON
schema, Stop / Retry / Clear (one reply at a time) and each token's probability. Handlers take the ModelRegistry."""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial

import gradio as gr

from engine import FINISH_ABORT, EngineError
from engine.registry import ModelRegistry
from engine.text.reasoning import reply_start_for, thinking_kwargs
from ui.feedback import report_error
from ui.models import build_model_picker, lease_model, loading_message, needs_loading
from ui.sampling import SamplingControls, build_sampling_controls, sampling_params
from ui.schema import STREAMING, check_reply, compile_schema, render_json_reply
from ui.tokens import LEGEND_HTML, render_tokens_html, token_views

# History: a list of turns {"role": "user" | "assistant", "content": str, "tokens": list[TokenView] | None}; an
# assistant turn made under a JSON schema also has "json_check": JsonCheck (ui/schema.py). "content" is always the
# raw text: the chatbot shows a rendering of it; the prompt is built from it, never from the rendered HTML. A thinking
# model's reply keeps its reasoning apart in "reasoning" (engine/text/reasoning.py), shown folded above the answer.

REASONING_TITLE = "Reasoning"
INPUT_PLACEHOLDER = "Type a message and press Enter"
BUSY_PLACEHOLDER = "Replying\u2026 wait for the reply to finish, or press Stop"
# A disabled textbox loses the keyboard focus; give it back once the reply has ended, unless the user has since
# put the focus somewhere else. A frame later: the textbox is enabled by then.
REFOCUS_JS = """() => requestAnimationFrame(() => {
  if (document.activeElement && document.activeElement !== document.body) return;
  document.querySelector('#chat-input textarea')?.focus();
})"""


@dataclass
class ChatSession:
    """What the events of one browser tab share. It lives in a gr.State, and Gradio hands every event of that tab
    the same object, so a reply that is streaming sees the tab's later clicks: it renders each update in the view
    the "Show token probabilities" checkbox chose at that moment, so a toggle applies mid-stream; and it stops once
    Clear has emptied the conversation it belongs to."""

    show_probs: bool = False
    num_clears: int = 0
    # Set when no reply streams into this conversation: Clear waits for it (see clear_chat).
    reply_ended: asyncio.Event | None = None


def add_user_message(message: str, history: list[dict], show_probs: bool) -> tuple:
    """Append the typed message to the conversation and clear the textbox. -> (textbox, history, chatbot, notice)"""
    if not message or not message.strip():
        return message, history, render_chatbot(history, show_probs), ""
    history = [*history, {"role": "user", "content": message, "tokens": None}]
    return "", history, render_chatbot(history, show_probs), ""


async def generate_reply(
    registry: ModelRegistry,
    history: list[dict],
    system_prompt: str,
    session: ChatSession,
    temperature: float,
    top_p: float,
    top_k: int,
    max_tokens: int,
    seed: str | None,
    stop: str,
    schema_text: str = "",
    model: str | None = None,
):
    """Stream `model`'s answer to the last user turn (loading the model first, saying so, when it is not loaded).
    Yields (chatbot, history, notice) as tokens arrive. With a JSON schema the reply is held to it, then shown
    indented with whether it validated. Each update renders the chatbot in the view chosen at that moment
    (`session.show_probs` may change while the reply streams). Stop, closing the tab and Gradio's cancellation all
    end this generator early; the request is then aborted (the engine frees its KV blocks) and the lease released."""
    if not history or history[-1]["role"] != "user":
        yield render_chatbot(history, session.show_probs), history, ""
        return
    try:
        if needs_loading(registry, model):
            yield render_chatbot(history, session.show_probs), history, loading_message(registry.resolve(model))
        lease = await lease_model(registry, model)
    except EngineError as exc:
        yield render_chatbot(history, session.show_probs), history, report_error(exc)
        return
    # Closed before the lease is released, however this generator ends: the request is aborted first.
    with lease:
        async with aclosing(_reply_on(lease.engine, history, system_prompt, session, schema_text, temperature, top_p,
                                      top_k, max_tokens, seed, stop)) as updates:
            async for update in updates:
                yield update


async def _reply_on(engine, history, system_prompt, session, schema_text, *controls):
    temperature, top_p, top_k, max_tokens, seed, stop = controls
    try:
        # Off the event loop: compiling a schema must not hold up the other users' streams.
        schema = await asyncio.to_thread(compile_schema, engine, schema_text)
        params = sampling_params(temperature, top_p, top_k, max_tokens, seed, stop,
                                 grammar=schema.grammar if schema else None)
        # As on the API (api/reasoning.py): a reply held to a schema renders with thinking off and is all answer.
        tags = engine.tokenizer.reasoning
        prompt = engine.tokenizer.render_chat(build_messages(history, system_prompt),
                                              template_kwargs=thinking_kwargs(tags, bool(schema)))
        start = reply_start_for(tags, prompt, bool(schema))
        stream = engine.submit(engine.tokenizer.encode(prompt, add_special_tokens=False), params)
    except EngineError as exc:
        yield render_chatbot(history, session.show_probs), history, report_error(exc)
        return
    num_clears = session.num_clears
    ended = session.reply_ended = asyncio.Event()
    reply = {"role": "assistant", "content": "", "tokens": []}
    thought = tags.parser(start) if start is not None else None
    if thought is not None:
        reply["reasoning"], reply["is_thinking"] = "", True
    if schema:
        reply["json_check"] = STREAMING
    history = [*history, reply]
    notice = ""
    try:
        async for out in stream:
            # Clear cancels this generator, but Gradio does so in a separate request: a token that arrives first must
            # not write the cleared conversation back into the chatbot and the history.
            if session.num_clears != num_clears:
                return
            if thought is None:
                reply["content"] += out.text
            else:
                _add_reasoned(reply, thought, out.text, out.finish_reason is not None)
            reply["tokens"] += token_views(out.logprobs or [], engine.tokenizer.token_text, engine.tokenizer.eos_ids)
            if out.finish_reason == "length":
                notice = f"The reply stopped at the limit of {params.max_tokens} new tokens (see Sampling settings)."
            elif out.finish_reason == FINISH_ABORT:
                notice = "\u26a0\ufe0f The server is shutting down: the reply was cut short."
            if schema and out.finish_reason:
                reply["json_check"] = check_reply(reply["content"], schema.schema, out.finish_reason, params.max_tokens)
            yield render_chatbot(history, session.show_probs), history, notice
    except Exception as exc:  # a failure delivered mid-stream; the conversation so far stays usable
        yield render_chatbot(history, session.show_probs), history, report_error(exc)
    finally:
        stream.close()  # stopped early (Stop, a closed tab): the engine frees its KV blocks now
        ended.set()


def _add_reasoned(reply: dict, thought, text: str, is_last: bool) -> None:
    """A thinking model's text, split as it streams: reasoning to "reasoning", the answer to "content"."""
    reasoning, answer = thought.feed(text)
    if is_last:
        more_reasoning, more_answer = thought.finish()
        reasoning, answer = reasoning + more_reasoning, answer + more_answer
    reply["reasoning"] += reasoning
    reply["content"] += answer
    reply["is_thinking"] = not is_last and not reply["content"]


def drop_last_reply(history: list[dict], show_probs: bool) -> tuple:
    """Retry, first half: remove the last assistant turn so generate_reply answers the same user turn again."""
    if history and history[-1]["role"] == "assistant":
        history = history[:-1]
    return history, render_chatbot(history, show_probs), ""


def show_token_view(session: ChatSession, history: list[dict], show_probs: bool) -> tuple:
    """The "Show token probabilities" checkbox: re-render the chatbot now, and tell a reply that is still streaming
    to keep to the new view. -> (chatbot, legend)"""
    session.show_probs = show_probs
    return render_chatbot(history, show_probs), gr.update(visible=show_probs)


def input_updates(is_generating: bool) -> tuple:
    """(textbox, Send, Retry) while a reply streams or once it has ended: one reply at a time per conversation, so
    that no second generation races the first over the same history."""
    placeholder = BUSY_PLACEHOLDER if is_generating else INPUT_PLACEHOLDER
    return (gr.update(interactive=not is_generating, placeholder=placeholder),
            gr.update(interactive=not is_generating), gr.update(interactive=not is_generating))


# How long Clear waits for a streaming reply to end: it ends at its next token or when Gradio cancels it, so this
# bounds only a step that takes longer (a long prompt's prefill); the conversation is emptied either way.
CLEAR_WAIT_S = 10.0


async def clear_chat(session: ChatSession) -> tuple:
    """Empty the conversation, and end a reply still streaming into it. -> (chatbot, history, notice), all empty.

    Returns once that reply has ended. Its updates travel to the page on the queue's stream and this answer on a
    request of its own, so an update the reply sent just before Clear could otherwise reach the page after the
    empty conversation and write the reply back (seen in the browser test)."""
    session.num_clears += 1
    ended = session.reply_ended
    if ended is not None:
        try:
            await asyncio.wait_for(ended.wait(), CLEAR_WAIT_S)
        except TimeoutError:
            pass
    return [], [], ""


def build_messages(history: list[dict], system_prompt: str) -> list[dict]:
    """The messages the chat template sees: the system prompt (when given), then every turn as plain text (a thinking
    model's reasoning as `reasoning_content`, which its template keeps or drops)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt and system_prompt.strip() else []
    for turn in history:
        message = {"role": turn["role"], "content": turn["content"]}
        if turn.get("reasoning") is not None:
            message["reasoning_content"] = turn["reasoning"]
        messages.append(message)
    return messages


def render_chatbot(history: list[dict], show_probs: bool) -> list[dict]:
    """History -> chatbot messages; with show_probs, assistant turns become coloured tokens; a reply made under a
    JSON schema becomes a JSON code block (or its coloured tokens) and a line saying whether it validated. A thinking
    model's reasoning is a folded message of its own above the answer (open, with a spinner, while it thinks)."""
    messages = []
    for turn in history:
        if turn.get("reasoning"):
            status = "pending" if turn.get("is_thinking") else "done"
            messages.append({"role": "assistant", "content": turn["reasoning"],
                             "metadata": {"title": REASONING_TITLE, "status": status}})
            if not turn["content"] and not (show_probs and turn.get("tokens")):
                continue  # no answer yet (or none: cut while thinking)
        content, check = turn["content"], turn.get("json_check")
        if show_probs and turn.get("tokens"):
            content = render_tokens_html(turn["tokens"], legend=False)
            if check is not None and check.mark:  # a blank line ends the HTML block: the mark is Markdown again
                content = f"{content}\n\n{check.mark}"
        elif check is not None:
            content = render_json_reply(content, check)
        messages.append({"role": turn["role"], "content": content})
    return messages


def build_chat_tab(registry: ModelRegistry) -> None:
    """Lay out the Chat tab and wire its events (inside a gr.Blocks context)."""
    history = gr.State([])
    session = gr.State(ChatSession())  # deep-copied for each browser tab
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, min_width=320):
            model = build_model_picker(registry, "chat-model")
            chatbot = gr.Chatbot(
                label="Conversation", elem_id="chat-log", height=460, latex_delimiters=[], buttons=["copy"],
                placeholder="Ask the model anything. Replies stream in as they are generated.",
                feedback_options=None,
            )
            legend = gr.HTML(LEGEND_HTML, visible=False, elem_id="chat-legend")
            notice = gr.Markdown(elem_id="chat-notice")
            with gr.Row(equal_height=True):
                message = gr.Textbox(
                    placeholder=INPUT_PLACEHOLDER, show_label=False, lines=1, max_lines=8,
                    scale=5, min_width=200, elem_id="chat-input", autofocus=True,
                )
                send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="chat-send")
            with gr.Row():
                stop = gr.Button("Stop", variant="stop", size="sm", elem_id="chat-stop", min_width=70)
                retry = gr.Button("Retry", size="sm", elem_id="chat-retry", min_width=70)
                clear = gr.Button("Clear", size="sm", elem_id="chat-clear", min_width=70)
        with gr.Column(scale=2, min_width=280):
            system_prompt = gr.Textbox(
                label="System prompt", lines=3, max_lines=10, elem_id="chat-system",
                placeholder="Optional: how the assistant should behave (the model's default is used when blank)",
            )
            show_probs = gr.Checkbox(label="Show token probabilities", elem_id="chat-show-probs",
                                     info="colour each generated token by how likely the model found it")
            controls: SamplingControls = build_sampling_controls("chat", default_max_tokens=256)
            with gr.Accordion("JSON output", open=False, elem_id="chat-json"):
                schema_box = gr.Textbox(
                    label="JSON schema", lines=4, max_lines=16, elem_id="chat-schema",
                    placeholder='{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
                    info="the reply is held to this JSON Schema, then shown indented and validated; "
                         "blank = free text. Asking for JSON in the message helps the model fill it in well.",
                )

    # The model last: a Gradio API call written for one model (no model argument) still means the same.
    reply_inputs = [history, system_prompt, session, *controls.inputs, schema_box, model]
    reply_outputs = [chatbot, history, notice]
    reply = partial(generate_reply, registry)
    send_events = [
        trigger(add_user_message, [message, history, show_probs], [message, history, chatbot, notice], queue=False)
        .then(reply, reply_inputs, reply_outputs, concurrency_limit=None, show_progress="minimal")
        for trigger in (message.submit, send.click)
    ]
    retry_event = retry.click(drop_last_reply, [history, show_probs], [history, chatbot, notice], queue=False).then(
        reply, reply_inputs, reply_outputs, concurrency_limit=None, show_progress="minimal"
    )
    generating = [*send_events, retry_event]
    # One reply at a time: whatever starts one locks the textbox, Send and Retry in the same click, and they unlock
    # when it ends. Gradio's front end runs a .then() after the event before it however that one ended: finished,
    # failed, or cancelled by Stop or Clear.
    locked = [message, send, retry]
    for starting in (message.submit, send.click, retry.click):
        starting(partial(input_updates, True), None, locked, queue=False, show_progress="hidden")
    for event in generating:
        event.then(partial(input_updates, False), None, locked, queue=False, show_progress="hidden").then(
            None, js=REFOCUS_JS)
    stop.click(None, cancels=generating)
    for clearing in (clear.click, chatbot.clear):  # our button and the chatbot's own bin icon
        clearing(clear_chat, [session], [chatbot, history, notice], cancels=generating, queue=False)
    show_probs.change(show_token_view, [session, history, show_probs], [chatbot, legend], queue=False)
