"""Source trees against each other: one measurement per tree, each in a child process of its own started in that
tree, alternated rounds (the order reversed every other round), so drift in the machine's speed hits every tree.
Used by bench/prefill.py and bench/decode.py; a baseline tree is a checkout of an earlier commit
(`git worktree add /tmp/baseline-checkout <commit>`, with the same .venv linked in).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

RESULT_MARK = "RESULT "  # the child prints one line: RESULT <json>


def print_result(result: dict) -> None:
    """The child's last word: what `alternate` reads back."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def alternate(trees: list[Path], rounds: int, child_command: list[str]) -> Iterator[tuple[int, dict[Path, dict]]]:
    """Per round (1-based), each tree's result: `child_command` run with the tree as its working directory."""
    for round_ in range(rounds):
        order = trees if round_ % 2 == 0 else trees[::-1]
        results = {}
        for tree in order:
            output = subprocess.run(child_command, cwd=tree, capture_output=True, text=True, check=True).stdout
            results[tree] = json.loads(output.split(RESULT_MARK, 1)[1])
        yield round_ + 1, results
