"""Model loading: the default GGUF is read with its exact values and caches only its config and tokenizer, and bad
--model values fail in one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, ModelLoadError
from engine.weights.checkpoint import default_gguf_path, resolve_checkpoint
from engine.weights.loader import read_state_dict

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_default_gguf_loads_with_exactly_the_weights_transformers_reads_from_it(default_checkpoint, tmp_path):
    """Read block by block (quantization none keeps every value as float32), the default model's weights are the
    ones transformers de-quantizes from the same file, q and k rows in transformers' order."""
    from engine.weights.loader import load

    loaded = load(EngineConfig(quantization="none", dtype="float32", cache_dir=str(tmp_path)))
    expected = read_state_dict(default_checkpoint)  # transformers' own de-quantization, cached by the fixture
    ours = loaded.model.state_dict()
    for index in range(loaded.hf_config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"]}
        for name, parts in fused.items():
            stacked = torch.cat([expected.pop(prefix + part + ".weight") for part in parts])
            assert torch.equal(ours.pop(prefix + name + ".weight"), stacked), prefix + name
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    assert torch.equal(ours["lm_head.weight"], expected["model.embed_tokens.weight"])  # tied


@pytest.mark.slow
def test_a_second_start_reuses_the_small_metadata_cache(tmp_path):
    folder, name = resolve_checkpoint(None, tmp_path)
    assert name == "SmolLM2-135M-Instruct" and (folder / "config.json").exists()
    assert resolve_checkpoint(None, tmp_path)[0] == folder
    cached = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert cached < default_gguf_path().stat().st_size / 4  # config and tokenizer only, no weights


def test_the_default_models_tokenizer_splits_text_as_its_own_tokenizer_and_llama_cpp_do(tmp_path):
    """SmolLM2's tokenizer puts each digit on its own before GPT-2's split (its GGUF says pre-tokenizer "smollm",
    which transformers' GGUF reader does not know): the blank line and indent before a digit are one token, as
    llama.cpp's llama-tokenize gives them, not three spaces plus one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(None, tmp_path)[0])
    ids = tokenizer.encode("in 2024:\n\n    1.5", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["in", " ", "2", "0", "2", "4", ":", "\n\n    ", "1", ".", "5"]


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
    # The kernels' build starts on a thread of its own at start-up and may log an INFO line before or after the
    # error: the error is one line of its own, and nothing else printed is more than a log line.
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: model 'nobody/no-such-model-anywhere'")
    assert all(" INFO " in line for line in lines if line not in errors)


def test_auto_dtype_is_float32_where_tern_kernels_serve_the_weights():
    """Tern's int8/int4 kernels quantize activations whatever their dtype, and their native decode step computes
    in float32: `auto` gives float32 there, so that step serves from the first request instead of a compiled bf16
    one built in the background. Other CPU modes keep bf16 where the CPU computes it natively."""
    from engine.weights.loader import _cpu_has_native_bf16, choose_dtype

    cpu = torch.device("cpu")
    for mode in ("auto", "int8", "int4"):
        assert choose_dtype("auto", cpu, mode, "avx2") == torch.float32
        assert choose_dtype("auto", cpu, mode, "avx512") == torch.float32
    native_bf16 = torch.bfloat16 if _cpu_has_native_bf16() else torch.float32
    assert choose_dtype("auto", cpu, "none", "avx512") == native_bf16
    assert choose_dtype("auto", cpu, "int8", "off") == native_bf16  # aten's ops: nothing runs the native step
    assert choose_dtype("bfloat16", cpu, "int4", "avx2") == torch.bfloat16  # asked for: kept


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_safetensors_folder_quantized_here_loads_tensor_by_tensor_with_the_whole_loads_values(tiny_checkpoint,
                                                                                                mode, tmp_path):
    """Read tensor by tensor (engine/weights/streamed_load.py), a folder's layers hold exactly what quantizing the whole
    state dict gives (the path a folder takes in other modes), so streaming changes memory, not answers."""
    from transformers import AutoConfig

    from engine.weights import quant
    from engine.weights.loader import build_native, load

    loaded = load(EngineConfig(model=str(tiny_checkpoint), quantization=mode, dtype="float32",
                               cache_dir=str(tmp_path)))
    whole = build_native(AutoConfig.from_pretrained(tiny_checkpoint), read_state_dict(tiny_checkpoint),
                         torch.float32, torch.device("cpu"))
    quant.quantize(whole, mode, torch.device("cpu"), torch.float32)
    quant.pack_for_cpu(whole, loaded.kernels)
    ours, theirs = loaded.model.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
