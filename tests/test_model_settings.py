"""Which models a server serves, as `python app.py` reads them: --model once (as always), repeated, or a --models YAML
file with each model's id and options; --keep-alive and --max-loaded; and a bad file refused in one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tern.settings import SettingsError, parse_args  # noqa: E402


@pytest.fixture(autouse=True)
def no_tern_environment(monkeypatch):
    for name in ("TERN_MODEL", "TERN_MODELS", "TERN_KEEP_ALIVE", "TERN_MAX_LOADED", "TERN_SERVED_MODEL_NAME",
                 "TERN_QUANTIZATION", "TERN_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)


def write(folder: Path, text: str) -> str:
    path = folder / "models.yaml"
    path.write_text(text)
    return str(path)


def test_one_model_keeps_its_id_and_is_never_unloaded():
    server, specs, _ = parse_args(["--model", "/m/SmolLM2-360M-Instruct.Q4_K_M.gguf", "--quantization", "int8"])
    (spec,) = specs
    assert spec.id == "SmolLM2-360M-Instruct" and spec.keep_alive_s is None  # --keep-alive is for several
    assert (spec.config.model, spec.config.quantization) == ("/m/SmolLM2-360M-Instruct.Q4_K_M.gguf", "int8")
    assert parse_args(["--model", "/m/a.gguf", "--served-model-name", "mine"])[1][0].id == "mine"
    (default,) = parse_args([])[1]
    assert default.id == "SmolLM2-135M-Instruct" and default.config.model is None


def test_repeated_models_are_named_by_their_files_and_share_the_flags(monkeypatch):
    server, specs, _ = parse_args(["--model", "/m/a.gguf", "--model", "/m/qwen-folder", "--model", "org/hub-model",
                                   "--keep-alive", "60", "--max-loaded", "2", "--max-model-len", "1024"])
    assert [s.id for s in specs] == ["a", "qwen-folder", "hub-model"]  # the first: the default, loaded at start
    assert {s.keep_alive_s for s in specs} == {60.0} and server.max_loaded == 2
    assert {s.config.max_model_len for s in specs} == {1024}
    assert parse_args(["--model", "/m/a.gguf", "--model", "/m/b.gguf"])[1][0].keep_alive_s == 300.0  # the default
    assert parse_args(["--model", "/m/a.gguf", "--model", "/m/b.gguf", "--keep-alive", "-1"])[1][0].keep_alive_s is None
    monkeypatch.setenv("TERN_MODEL", "/m/a.gguf, /m/b.gguf")
    monkeypatch.setenv("TERN_KEEP_ALIVE", "5")
    assert [(s.id, s.keep_alive_s) for s in parse_args([])[1]] == [("a", 5.0), ("b", 5.0)]
    assert [s.id for s in parse_args(["--model", "/m/c.gguf"])[1]] == ["c"]  # the flag over the environment


def test_a_models_file_names_each_model_and_sets_its_own_options(tmp_path):
    path = write(tmp_path, """
models:
  - id: smol
    path: /m/SmolLM2-135M-Instruct.Q4_K_M.gguf
    quantization: int4
    keep_alive: -1
  - path: /m/qwen-folder
    max_model_len: 2048
  - /m/plain.gguf
""")
    server, specs, _ = parse_args(["--models", path, "--quantization", "int8", "--keep-alive", "30"])
    assert [s.id for s in specs] == ["smol", "qwen-folder", "plain"]
    assert [s.config.quantization for s in specs] == ["int4", "int8", "int8"]  # its own, else the flag's
    assert [s.config.max_model_len for s in specs] == [None, 2048, None]
    assert [s.keep_alive_s for s in specs] == [None, 30.0, 30.0]
    assert server.models_file == path


@pytest.mark.parametrize("text, says", [
    ("models: [path: /m/a.gguf\n", "not valid YAML"),
    ("models: {}\n", "expected a `models:` list"),
    ("models:\n  - id: a\n", "model 1: each entry needs a `path`"),
    ("models:\n  - {path: /m/a.gguf, quantisation: int8}\n", "unknown option `quantisation`"),
    ("models:\n  - {path: /m/a.gguf, quantization: int3}\n", "quantization must be one of"),
    ("models:\n  - {path: /m/a.gguf, keep_alive: soon}\n", "keep_alive must be 0 or more seconds"),
    ("models:\n  - /m/a.gguf\n  - /n/a.gguf\n", "two models would be served as `a`"),
])
def test_a_bad_models_file_is_one_line_saying_what_is_wrong(tmp_path, text, says):
    with pytest.raises(SettingsError) as caught:
        parse_args(["--models", write(tmp_path, text)])
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_models_that_cannot_be_served_together_are_refused(tmp_path):
    with pytest.raises(SettingsError, match="not both"):
        parse_args(["--models", write(tmp_path, "models: [/m/a.gguf]\n"), "--model", "/m/b.gguf"])
    with pytest.raises(SettingsError, match="names a single model"):
        parse_args(["--model", "/m/a.gguf", "--model", "/m/b.gguf", "--served-model-name", "x"])
    with pytest.raises(SettingsError, match="cannot read it"):
        parse_args(["--models", str(tmp_path / "missing.yaml")])
    with pytest.raises(SystemExit):  # argparse's own message: must be 0 or more seconds, or -1
        parse_args(["--keep-alive", "-5"])


def test_the_server_refuses_a_bad_models_file_in_one_line_before_loading_anything(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "app.py"), "--models", write(tmp_path, "models: 3\n")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith("error: --models ")
    missing = subprocess.run([sys.executable, str(ROOT / "app.py"), "--model", str(tmp_path / "a.gguf"), "--model",
                              str(tmp_path / "b.gguf")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "a.gguf does not exist" in missing.stderr.strip().splitlines()[-1]
