"""An unloaded model gives its memory back: the process's RSS after the default model is unloaded comes back within
10% of what it was before the model loaded, the median of the three rounds after a first load (which also keeps what
any first load imports) (bench/unload_memory.py, in a process of its own so no other test's memory counts)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from Linux's /proc")
def test_unloading_the_default_model_gives_its_memory_back():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "unload_memory.py"), "--rounds", "4",
                           "--max-growth", "0.10"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
