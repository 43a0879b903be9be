"""Choosing the kernel path: from the CPU's flags, forced by TERN_CPU_KERNELS, falling back (with the reason, at
WARNING) when a path cannot run or cannot be built; the build honours the cache folder, survives an unwritable
one and stops a compiler that hangs."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import kernels
from engine.config import default_cache_dir
from engine.kernels import build, dispatch

ROOT = Path(__file__).resolve().parents[3]


def _best_path() -> str:
    return next(path for path in kernels.PATHS if kernels.unsupported_reason(path) is None)


def test_auto_takes_the_best_path_this_cpu_supports_and_says_why_not_a_better_one(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    path, why = kernels.planned_path()
    assert path == _best_path()
    if path != kernels.PATHS[0]:  # a better path exists: why not it
        assert f"{kernels.PATHS[0]}: " in why
    else:
        assert why == "the best this CPU supports"


@pytest.mark.parametrize("forced", kernels.PATHS)
def test_the_environment_variable_forces_a_path_the_cpu_supports(monkeypatch, caplog, tmp_path, forced):
    reason = kernels.unsupported_reason(forced)
    monkeypatch.setenv(kernels.ENV_VAR, forced)
    path, why = kernels.planned_path()
    if reason:  # a path this CPU lacks: the best one it has, with the reason
        assert path == _best_path() and reason in why and f"{kernels.ENV_VAR}={forced}" in why
        return
    assert (path, why) == (forced, f"forced by {kernels.ENV_VAR}={forced}")
    if forced == "off":  # nothing to build: the fallback is taken, and said at WARNING level
        with caplog.at_level(logging.INFO, logger="engine.kernels.dispatch"):
            selected = kernels.select(tmp_path)
        assert selected.path == "off" and selected.q8_mm is None and selected.decode_attention is None
        [record] = [r for r in caplog.records if r.name == "engine.kernels.dispatch"]
        assert record.levelno == logging.WARNING and "int8: aten" in record.getMessage()


@pytest.mark.parametrize("path", kernels.PATHS)
def test_every_path_this_cpu_supports_builds_and_loads(path):
    """The parity tests skip a path that cannot be built, naming the compiler's error; this one fails instead, so a
    kernel source that stops compiling cannot pass as a path this CPU lacks."""
    if kernels.unsupported_reason(path):
        pytest.skip(f"this CPU cannot take {path}: {kernels.unsupported_reason(path)}")
    assert kernels.kernels_for(path, default_cache_dir()).path == path


@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")
@pytest.mark.parametrize("source", sorted(build.KERNEL_SOURCES))
def test_every_kernel_source_compiles_for_its_instruction_set_on_any_cpu(source):
    """A path's library is every source of its instruction sets, so one that does not compile puts every CPU of
    that path on `off`; the compiler checks a source on any CPU, so this catches a path this machine cannot run
    (the AMX kernels once stopped compiling, unseen on machines without AMX)."""
    flags = build.ISA_FLAGS[build.KERNEL_SOURCES[source]]
    compiled = subprocess.run([build.compiler(), *build.COMMON_FLAGS, *flags, "-fsyntax-only", str(build.CSRC / source)],
                              capture_output=True, text=True, timeout=600)
    assert compiled.returncode == 0, compiled.stderr[-3000:]


def test_an_unknown_path_is_named_and_the_best_one_taken(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "neon")
    path, why = kernels.planned_path()
    assert path == _best_path() and "unknown kernel path 'neon'" in why


def test_a_path_the_cpu_lacks_is_refused_with_the_missing_flags(monkeypatch):
    monkeypatch.setattr(dispatch, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma"}))  # no f16c, no avx512
    assert kernels.unsupported_reason("avx2") == "this CPU lacks f16c"
    assert "avx512f" in kernels.unsupported_reason("avx512")
    assert "amx_tile, amx_int8" in kernels.unsupported_reason("amx")
    with pytest.raises(kernels.KernelsUnavailable, match="lacks f16c"):
        kernels.kernels_for("avx2", Path("/nonexistent"))
    monkeypatch.setattr(dispatch.platform, "machine", lambda: "aarch64")
    assert "aarch64 CPUs have no Tern kernels yet" in kernels.unsupported_reason("avx2")
    assert kernels.planned_path("auto")[0] == "off"


def test_amx_needs_linux_to_grant_the_tile_state(monkeypatch):
    """A CPU with AMX whose kernel (or hypervisor) refuses the process AMX's tile state takes avx512, saying why;
    where granted, the path says which kernels use the tiles."""
    amx_cpu = frozenset(dispatch.REQUIRED_FLAGS["amx"])
    monkeypatch.setattr(dispatch, "cpu_flags", lambda: amx_cpu)
    monkeypatch.setattr(dispatch.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(dispatch, "_linux_grants_amx", lambda: False)
    assert "Linux refuses" in kernels.unsupported_reason("amx")
    path, why = kernels.planned_path("auto")
    assert path == "avx512" and "amx: Linux refuses" in why
    monkeypatch.setattr(dispatch, "_linux_grants_amx", lambda: True)
    assert kernels.planned_path("auto") == ("amx", "the best this CPU supports")
    assert "q8, q4, q4k, q6k: amx-int8" in dispatch.describe_path("amx") and "amx" not in dispatch.describe_path("avx512")


def test_a_failed_build_falls_back_to_aten_with_the_compilers_reason(monkeypatch, caplog, tmp_path):
    if kernels.unsupported_reason(_best_path()) or _best_path() == "off":
        pytest.skip("no kernel path to build on this CPU")

    def failing(cache_dir):
        raise kernels.KernelsUnavailable("the compiler failed on ops.cpp: error: no space left on device")

    monkeypatch.setattr(dispatch, "_load_library", failing)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.dispatch"):
        selected = kernels.select(tmp_path)
    assert selected.path == "off" and "no space left on device" in selected.reason
    assert any("no space left on device" in r.getMessage() for r in caplog.records)


def test_a_hung_compiler_is_stopped_and_a_failing_one_quoted(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 1)
    with pytest.raises(build.BuildError, match="took over 1 s"):
        build._run([sys.executable, "-c", "import time; time.sleep(30)"])
    bad = tmp_path / "bad.cpp"
    bad.write_text("int main() { return undefined_name; }\n")
    with pytest.raises(build.BuildError, match="the compiler failed on bad.cpp: .*undefined_name"):
        build._run([build.compiler() or "g++", "-c", str(bad), "-o", str(tmp_path / "bad.o")])


@pytest.mark.slow
def test_the_build_uses_the_cache_folder_it_is_given_and_a_temporary_one_when_that_cannot_be_written(tmp_path):
    """In a fresh process each (a process loads the library once): --cache-dir is honoured, and a cache folder
    that cannot be created (here: under a file) sends the build to a temporary folder instead of failing."""
    if kernels.unsupported_reason("avx2"):
        pytest.skip(f"no avx2 kernels here: {kernels.unsupported_reason('avx2')}")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    script = ("import sys; from pathlib import Path; from engine.kernels import build; "
              "print(build.load_library(('avx2',), Path(sys.argv[1])))")
    for cache, expect_inside in ((tmp_path / "cache", True), (blocker / "cache", False)):
        result = subprocess.run([sys.executable, "-c", script, str(cache)], cwd=ROOT, capture_output=True, text=True,
                                timeout=600, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")} if not expect_inside
                                else None)
        assert result.returncode == 0, result.stderr[-2000:]
        library = Path(result.stdout.strip().splitlines()[-1])
        assert library.exists() and library.suffix == ".so"
        if expect_inside:
            assert library.parent == cache / "kernels"
        else:
            assert str(library).startswith(str(tmp_path / "tmp"))


def test_help_names_the_kernel_path_and_how_to_force_one():
    for forced in ("auto", "off"):
        env = {**os.environ, kernels.ENV_VAR: forced}
        result = subprocess.run([sys.executable, "app.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env=env)
        assert result.returncode == 0
        text = " ".join(result.stdout.split())
        expected = "off" if forced == "off" else _best_path()
        assert f"CPU kernels on this machine: {expected} (int8:" in text
        assert "TERN_CPU_KERNELS=amx|avx512|avx2|off" in text


# A build that cannot happen, each in a fresh process (a process builds and loads the library once): `select` takes
# the `off` path and says why at WARNING, so an operator reading the start-up log knows the server runs on aten.
_SELECT = (
    "import logging, sys; from pathlib import Path; "
    "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(levelname)s %(name)s: %(message)s'); "
    "from engine import kernels; print('selected', kernels.select(Path(sys.argv[1])).path)"
)


def _select_in_a_fresh_process(cache_dir: Path, **env: str) -> str:
    if kernels.unsupported_reason("avx2") and "compiler" not in kernels.unsupported_reason("avx2"):
        pytest.skip(f"no kernel path to build on this CPU: {kernels.unsupported_reason('avx2')}")
    base = {k: v for k, v in os.environ.items() if k not in (kernels.ENV_VAR, "CXX")}  # auto, the usual compiler
    result = subprocess.run([sys.executable, "-c", _SELECT, str(cache_dir)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**base, **env})
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _fallback_line(log: str) -> str:
    assert log.splitlines()[-1] == "selected off", log
    [line] = [line for line in log.splitlines() if line.startswith("WARNING engine.kernels.dispatch: CPU kernels: off")]
    return line


def test_no_compiler_on_path_falls_back_to_off_and_says_so(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    line = _fallback_line(_select_in_a_fresh_process(tmp_path / "cache", PATH=str(empty_bin)))
    assert "avx2: no C++ compiler (g++) to build the kernels" in line


def test_a_compiler_that_fails_falls_back_to_off_and_says_so(tmp_path):
    line = _fallback_line(_select_in_a_fresh_process(tmp_path / "cache", CXX=shutil.which("false") or "/bin/false"))
    assert "could not be built: the compiler failed on ops.cpp" in line


def test_a_cache_and_a_temporary_folder_that_cannot_be_written_fall_back_to_off_and_say_so(tmp_path):
    """Folders that cannot be created: under a file (chmod would not stop root, who runs CI here). Each is named
    in the log; the kernels are never half-built."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    temp = tmp_path / "tmp"
    temp.mkdir()
    (temp / f"tern-kernels-{os.getuid()}").write_text("")  # where build.py falls back to
    log = _select_in_a_fresh_process(blocker / "cache", TMPDIR=str(temp))
    line = _fallback_line(log)
    assert "no writable folder to build them in" in line
    assert str(blocker / "cache" / "kernels") in line and str(temp / f"tern-kernels-{os.getuid()}") in line
    assert "WARNING engine.kernels.build: cannot write the CPU kernels to" in log
    assert not list(tmp_path.rglob("*.so"))
