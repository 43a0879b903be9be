"""The models one server serves: from --model (given once, or repeated) or a --models YAML file, each a ModelSpec
(its id, its checkpoint and engine options, its keep-alive).

Ids: one model keeps the id it always had (--served-model-name, else the checkpoint's name: a GGUF file's name up to
its first dot, a folder's name, a hub id's last part). With several, each is its YAML `id`, else its checkpoint's
name; two alike are an error that says to name them in a --models file. One model is never unloaded for idleness
(it loads at start, as a single-model server always has); with several, --keep-alive applies to each unless its
YAML entry says `keep_alive`.

A --models file:

    models:
      - id: smol                      # optional: the checkpoint's name otherwise
        path: /models/SmolLM2-135M-Instruct.Q4_K_M.gguf
        quantization: int8            # any engine flag, spelled as its EngineConfig field
        max_model_len: 2048
      - path: /models/qwen3-folder
        keep_alive: -1                # seconds; -1: never unloaded for idleness
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from engine import EngineConfig
from engine.registry import ModelSpec
from engine.weights.checkpoint import model_name

DEFAULT_KEEP_ALIVE_S = 300.0
# What a --models entry may set besides path, id and keep_alive: the engine's options, per model.
ENGINE_OPTIONS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model", "cache_dir"}


class SettingsError(ValueError):
    """Models that cannot be served as given; the message is one line saying what to change."""


def model_specs(models: list[str] | None, models_file: str | None, base: EngineConfig,
                served_model_name: str | None = None,
                keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S) -> list[ModelSpec]:
    """The specs, first the default one (a request that names no model gets it; it loads at start). `models`: the
    --model values (None or empty: the default model); `base`: the engine options every model shares."""
    if models and models_file:
        raise SettingsError("give --model or --models, not both")
    if models_file:
        entries = read_models_file(models_file)
    else:
        entries = [{"path": model} for model in models or [None]]
    if len(entries) > 1 and served_model_name:
        raise SettingsError("--served-model-name names a single model; with several, give each its id in a "
                            "--models file")
    single = len(entries) == 1
    specs = [_spec(entry, base, served_model_name if single else None, None if single else keep_alive_s,
                   where=f"{models_file}, model {number}" if models_file else "--model")
             for number, entry in enumerate(entries, 1)]
    ids = [spec.id for spec in specs]
    clashing = sorted({i for i in ids if ids.count(i) > 1})
    if clashing:
        raise SettingsError(f"two models would be served as `{clashing[0]}`: give each its own id in a --models file")
    return specs


def read_models_file(path: str) -> list[dict]:
    """The file's model entries, each a mapping with at least `path`; anything else is a SettingsError."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SettingsError(f"--models {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise SettingsError(f"--models {path}: not valid YAML{where}") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise SettingsError(f"--models {path}: expected a `models:` list with one entry per model")
    for number, entry in enumerate(entries, 1):
        if isinstance(entry, str):
            entries[number - 1] = entry = {"path": entry}
        if not isinstance(entry, dict) or not entry.get("path"):
            raise SettingsError(f"--models {path}, model {number}: each entry needs a `path`")
    return entries


def _spec(entry: dict, base: EngineConfig, served_model_name: str | None, keep_alive_s: float | None,
          where: str) -> ModelSpec:
    entry = dict(entry)
    model = entry.pop("path", None)
    model = str(model) if model is not None else None
    model_id = str(entry.pop("id", None) or served_model_name or model_name(model))
    if "keep_alive" in entry:
        keep_alive_s = _keep_alive(entry.pop("keep_alive"), where)
    unknown = sorted(set(entry) - ENGINE_OPTIONS)
    if unknown:
        raise SettingsError(f"{where}: unknown option `{unknown[0]}` (known: id, path, keep_alive, "
                            f"{', '.join(sorted(ENGINE_OPTIONS))})")
    try:
        config = dataclasses.replace(base, model=model, **entry)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {exc}") from None
    return ModelSpec(model_id, config, keep_alive_s)


def _keep_alive(value, where: str) -> float | None:
    if value == -1 or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise SettingsError(f"{where}: keep_alive must be 0 or more seconds, or -1 for never, got {value!r}")
    return float(value)
