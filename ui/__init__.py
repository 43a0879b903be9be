"""Gradio UI at "/": Chat, Complete, Score, Compare (with several models) and Server tabs over the in-process
engines of the ModelRegistry (never over HTTP)."""
from __future__ import annotations

import hmac
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from functools import partial


class _NoStubWriting(importlib.abc.MetaPathFinder):
    """Importing Gradio (6.31, requirements.txt) re-parses each component's source file and its .pyi stub, to keep
    the stubs in step for type checkers, every time: ~1 s of a server's start on 2 cores, for files it then finds
    unchanged. This finder hands out gradio.component_meta with that step (create_or_modify_pyi) a no-op; nothing
    else changes. Remove it once Gradio skips that step itself (its slow import: gradio-app/gradio#7791)."""

    def find_spec(self, name, path, target=None):
        if name != "gradio.component_meta":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            if hasattr(module, "create_or_modify_pyi"):
                module.create_or_modify_pyi = lambda *args, **kwargs: None

        spec.loader.exec_module = exec_module
        return spec


if "gradio" not in sys.modules:
    sys.meta_path.insert(0, _NoStubWriting())

import gradio as gr  # noqa: E402

from engine.registry import FAILED, LOADED, ModelRegistry
from ui.chat import build_chat_tab
from ui.compare import build_compare_tab
from ui.complete import build_complete_tab
from ui.scoring import build_scoring_tab
from ui.server import build_server_tab, describe_model

__all__ = ["LOGIN_MESSAGE", "build_ui", "key_login"]

LOGIN_MESSAGE = "This server has an API key: enter it as the password (any user name)."

HEADER_REFRESH_S = 3.0  # until the model has loaded

# Gradio's queue looks for new UI events every 1 ms and for progress to send every 10 ms, even when idle
# (gradio/queueing.py: Queue.sleep_when_free, progress_update_sleep_when_free). Each look wakes the event loop
# and takes the GIL: ~6% of a core while idle on the 2-core CPU machine, and up to ~17% of 16 decoding API
# streams' throughput, because every wake-up takes a core from the engine's matmul threads (bench/README.md, Performance).
# 20 ms before a UI event starts is not something a person notices.
QUEUE_POLL_S = 0.02
QUEUE_PROGRESS_POLL_S = 0.05

# tern/factory.py mounts with gr.mount_gradio_app(..., css=None), which resets Blocks(css=...); a <style> element
# inside the page works either way. Token colours are inline styles, so the views stay readable even without it.
PAGE_CSS = """
<style>
#tern-header h1 { margin-bottom: 0.2em; }
#tern-header p { color: var(--body-text-color); opacity: 0.85; margin-top: 0; }
@media (max-width: 640px) { #tern-header h1 { font-size: 1.6em; } }
.tern-token { border-radius: 3px; padding: 1px 0; cursor: help; box-decoration-break: clone;
  -webkit-box-decoration-break: clone; position: relative; }
.tern-token:hover { outline: 1px solid #6b7280; }
.tern-token:focus { outline: 2px solid #2563eb; }
.tern-token:focus::after { content: attr(title); position: absolute; left: 0; top: 1.9em; z-index: 50;
  white-space: pre; max-width: 80vw; overflow: hidden; text-overflow: ellipsis; font: 12px/1.5 ui-monospace, monospace;
  background: #111827; color: #f9fafb; padding: 6px 8px; border-radius: 6px; box-shadow: 0 4px 14px rgba(0,0,0,.25); }
.tern-legend { font-size: 12px; color: var(--body-text-color-subdued); margin-top: 6px; }
.tern-legend-swatch { border-radius: 3px; padding: 0 6px; margin-left: 4px; }
.tern-score-row { display: flex; gap: 10px; align-items: baseline; padding: 4px 0;
  border-bottom: 1px solid var(--border-color-primary); }
.tern-score-model { margin-top: 8px; font-size: 13px; }
.tern-score-rank { font-weight: 600; min-width: 2em; color: var(--body-text-color-subdued); }
#chat-notice p, #score-notice p, #complete-status p, #compare-status-a p, #compare-status-b p { margin: 0; }
</style>
"""


def build_ui(registry: ModelRegistry) -> gr.Blocks:
    """The whole UI; handlers lease an engine from `registry` for each action, so it can be built before any model
    loads. Every tab has a model picker (hidden with one model served); Compare is there with two or more."""
    # analytics_enabled=False: Gradio would otherwise report usage and check its version over the internet at
    # every start (two threads, and traffic an operator did not ask for); the server stays on its machine.
    with gr.Blocks(title="Tern", analytics_enabled=False) as blocks:
        gr.HTML(PAGE_CSS, padding=False, elem_id="tern-style")
        header = gr.Markdown(describe_model(registry), elem_id="tern-header")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                build_chat_tab(registry)
            with gr.Tab("Complete", id="complete"):
                build_complete_tab(registry)
            with gr.Tab("Score", id="score"):
                build_scoring_tab(registry)
            if len(registry.ids) > 1:
                with gr.Tab("Compare", id="compare"):
                    build_compare_tab(registry)
            with gr.Tab("Server", id="server"):
                build_server_tab(registry, blocks)

        header_timer = gr.Timer(HEADER_REFRESH_S)
        header_timer.tick(partial(_refresh_header, registry), None, [header, header_timer], show_progress="hidden",
                          queue=False)
        blocks.load(partial(_refresh_header, registry), None, [header, header_timer], queue=False)
    # Generating events already say concurrency_limit=None; this covers the rest: the engine batches users itself.
    blocks.queue(default_concurrency_limit=None)
    _poll_queue_less_often(blocks)
    return blocks


def key_login(api_key: str) -> Callable[[str, str], bool]:
    """Gradio's login check for a server with an API key: any user name, the key as password. Gradio then guards
    the page and every route of its own API (/gradio_api/call, /run, /queue/join, ...) with the session cookie."""
    expected = api_key.encode()

    def check(username: str, password: str) -> bool:
        # compare_digest: as with /v1's bearer check, timing reveals nothing of the key.
        return hmac.compare_digest((password or "").encode(), expected)

    return check


def _poll_queue_less_often(blocks: gr.Blocks) -> None:
    queue = blocks._queue
    queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
    queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, QUEUE_PROGRESS_POLL_S)


def _refresh_header(registry: ModelRegistry) -> tuple[str, gr.Timer]:
    """The default model's description; the timer stops once it is loaded (or has failed)."""
    return describe_model(registry), gr.Timer(active=registry.status().state not in (LOADED, FAILED))
