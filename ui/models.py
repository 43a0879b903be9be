"""Which model a UI action runs on: the model picker every tab shows (hidden when the server serves one model), the
"loading model X…" line while an unloaded model loads, and the lease an action holds on its engine until it ends."""
from __future__ import annotations

import gradio as gr

from engine.registry import LOADED, Lease, ModelRegistry, ModelStatus

# What a model's state means to a user; the Server tab's table and the pickers' loading lines say it alike.
STATE_TEXT = {
    "loaded": "loaded",
    "loading": "loading\u2026",
    "unloaded": "not loaded (loads on its first request)",
    "unloading": "unloading\u2026",
    "failed": "failed to load",
}


def build_model_picker(registry: ModelRegistry, elem_id: str, label: str = "Model",
                       value: str | None = None) -> gr.Dropdown:
    """A dropdown of the served models, on the default one. With one model served it is hidden: the UI looks as it
    did before the server could serve several, and every action runs on that model."""
    return gr.Dropdown(
        choices=registry.ids, value=value or registry.default_id, label=label, elem_id=elem_id,
        visible=len(registry.ids) > 1, interactive=True, filterable=False,
        info="an unloaded model loads on its first request",
    )


def needs_loading(registry: ModelRegistry, model: str | None) -> bool:
    """Whether an action on `model` will first wait for it to load (or for room to load it)."""
    return registry.status(model).state != LOADED


def loading_message(model_id: str) -> str:
    return f"\u23f3 Loading model `{model_id}`\u2026 (the first request to a model waits for it to load)"


async def lease_model(registry: ModelRegistry, model: str | None) -> Lease:
    """A lease on the model's engine, loading it first if needed, without holding a thread while it waits. Raises
    the registry's EngineErrors (unknown model, failed load, still loading at start-up, shutting down), which
    ui/feedback.report_error turns into a message. Cancelled (Stop, the tab closed), it leaves nothing held."""
    return await registry.acquire_async(model or None)


def status_rows(statuses: list[ModelStatus]) -> list[list[str]]:
    """One row per served model for the Server tab: id, state, in use, loads, last load time, idle time."""
    rows = []
    for status in statuses:
        state = STATE_TEXT.get(status.state, status.state)
        if status.error:
            state = f"{state}: {status.error}"
        rows.append([
            status.id, state, str(status.num_leases), str(status.num_loads),
            f"{status.last_load_s:.1f} s" if status.last_load_s is not None else "",
            f"{status.idle_s:.0f} s" if status.idle_s is not None else "",
        ])
    return rows


STATUS_HEADERS = ["Model", "State", "In use", "Loads", "Last load", "Idle"]
