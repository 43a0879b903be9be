"""Model loading: the cached conversion keeps the GGUF's weights exactly, and bad --model values fail in one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import ModelLoadError
from engine.loader import DEFAULT_MODEL_FILE, default_gguf_path, read_state_dict, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cached_checkpoint_holds_exactly_the_weights_transformers_loads_from_the_gguf(default_checkpoint):
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32)
    cached = read_state_dict(default_checkpoint)
    expected = reference.state_dict()
    expected.pop("lm_head.weight")  # tied to the embedding, stored once
    assert cached.keys() == expected.keys()
    for name, tensor in expected.items():
        assert cached[name].dtype == torch.float32
        assert torch.equal(cached[name], tensor), name


@pytest.mark.slow
def test_second_start_reuses_the_cache(default_checkpoint, tmp_path):
    folder, name = resolve_checkpoint(None, default_checkpoint.parent.parent)
    assert folder == default_checkpoint and name == "SmolLM2-135M-Instruct"


def test_bad_model_values_are_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"), tmp_path)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_checkpoint(str(tmp_path / "missing.bin"), tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Hugging Face cache"):
        resolve_checkpoint("nobody/no-such-model-anywhere", tmp_path)


def test_cli_reports_a_missing_model_in_one_line_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "app.py", "--model", "nobody/no-such-model-anywhere", "--cache-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error: model 'nobody/no-such-model-anywhere'")
