"""Weights written in 4 KB pages while a model loads, collapsed into huge pages after (engine/huge_pages.py): each
case runs in a child process, as torch's allocator reads THP_MEM_ALLOC_ENABLE once, before its first allocation."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OFFERED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

CHILD = r"""
import sys, torch
from engine import huge_pages

def huge_kb(tensor):
    # AnonHugePages of the mapping that holds the tensor (/proc/self/smaps)
    address, found, kb = tensor.data_ptr(), False, 0
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) > 1 and ":" not in fields[0]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found = start <= address < end
        elif found and fields[0] == "AnonHugePages:":
            kb = int(fields[1])
    return kb

with huge_pages.small_pages_while_loading() as deferred:
    weights = torch.arange(32 << 20, dtype=torch.int32) % 251  # 128 MB, written while loading
if not deferred:
    print("not deferred")
    sys.exit(0)
before = huge_kb(weights)
expected = weights.clone()
done = huge_pages.collapse_in_background([weights])
assert done.wait(120)
print(before, huge_kb(weights), bool(torch.equal(weights, expected)))
"""


def run_child(env_value: str) -> str:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": env_value}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not OFFERED.exists() or "[never]" in OFFERED.read_text(), reason="no transparent huge pages")
def test_weights_load_in_small_pages_and_move_into_huge_ones_after_with_their_values():
    result = run_child("1")
    if result == "not deferred":
        pytest.skip("this kernel cannot collapse memory into huge pages (MADV_COLLAPSE, Linux 6.1)")
    before_kb, after_kb, same = result.split()
    assert int(before_kb) == 0  # written in 4 KB pages: no huge page faulted in while loading
    assert int(after_kb) * 1024 >= 120 << 20  # then (nearly) all of its 128 MB in huge pages
    assert same == "True"


def test_without_huge_pages_asked_for_nothing_is_deferred():
    assert run_child("0") == "not deferred"
