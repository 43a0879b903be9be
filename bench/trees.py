"""Source trees against each other: one measurement per tree, each in a child process of its own started in that
tree, alternated rounds (the order reversed every other round), so drift in the machine's speed hits every tree.
Used by bench/prefill.py and bench/decode.py; a baseline tree is a checkout of an earlier commit
(`git worktree add /tmp/baseline-checkout <commit>`, with the same .venv linked in).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

RESULT_MARK = "RESULT "  # the child prints one line: RESULT <json>


def parser(description: str, reps: int) -> argparse.ArgumentParser:
    """The arguments every trees bench takes; the bench adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")],
                        help="source trees; the first is the baseline")
    parser.add_argument("--model", help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--reps", type=int, default=reps, help="measurements per tree and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def child_command(script: str, args: argparse.Namespace, *extra: str) -> list[str]:
    """`script` (a bench's __file__) as the child of one tree: --reps and --model passed on, then `extra`."""
    return [sys.executable, str(Path(script).resolve()), "--child", "--reps", str(args.reps)] \
        + (["--model", args.model] if args.model else []) + list(extra)


def print_result(result: dict) -> None:
    """The child's last word: what `alternate` reads back."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def write_bytecode(checkout: Path) -> None:
    """Each checkout's own modules compiled to bytecode once, as Python caches them at a user's first start: where
    PYTHONDONTWRITEBYTECODE is set (these VMs), every start compiled them again (~0.25 s of a 2-core start), which a
    user's second start does not."""
    sources = [str(checkout / name) for name in ("app.py", "api", "engine", "tern", "ui") if (checkout / name).exists()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sources], check=True, stdout=subprocess.DEVNULL)


def alternate(trees: list[Path], rounds: int, child_command: list[str]) -> Iterator[tuple[int, dict[Path, dict]]]:
    """Per round (1-based), each tree's result: `child_command` run with the tree as its working directory. Each tree
    keeps a cache folder of its own (<tree>/.bench-cache, unless TERN_CACHE is set): a kernel build removes the
    builds of other sources from its folder, so trees sharing one rebuilt their kernels (~1 min) every round."""
    for round_ in range(rounds):
        order = trees if round_ % 2 == 0 else trees[::-1]
        results = {}
        for tree in order:
            env = {**os.environ, "TERN_CACHE": os.environ.get("TERN_CACHE") or str(Path(tree).resolve() / ".bench-cache")}
            output = subprocess.run(child_command, cwd=tree, capture_output=True, text=True, check=True,
                                    env=env).stdout
            results[tree] = json.loads(output.split(RESULT_MARK, 1)[1])
        yield round_ + 1, results
