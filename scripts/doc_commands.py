"""Runs every command of the README and of the getting-started page as written, in a fresh clone, so that neither
can go stale: each ```bash block of those files, in order, in one bash session per file (`set -e`: the first
failing command stops it), with an empty cold-start cache.

Commands that train for minutes get tiny overrides (`TINY`): a `gspo-train` or `make train` runs a few RL steps of
a few prompts after a short cold start, a multirun keeps one seed, `make test` runs one test file. An override
replaces the command's own value of that key, or is appended. Everything else runs untouched.

    python scripts/doc_commands.py                # clones HEAD into a temporary folder (`make` installs there)
    python scripts/doc_commands.py --here         # runs in this checkout: CI's clean clone (.ci/run)
    python scripts/doc_commands.py --list         # prints the commands as they will run, runs nothing
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("README.md", "docs/getting-started.md")
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
# key -> value for every training command: a 25-step cold start, 2 RL steps of 4 prompts, 16 held-out prompts
TINY = {
    "train.steps": "2", "train.eval_every": "2", "rollout.prompts_per_step": "4", "task.eval_size": "16",
    "sft.steps": "25", "sft.eval_every": "25", "sft.eval_size": "16", "callbacks.progress.refresh_rate": "0",
}
MULTIRUN_TINY = {"seed": "0"}  # a multirun keeps one seed (the grid's other axes stay as written)
TEST_TINY = "tests/test_docs.py"  # what `make test` runs here instead of the quick suite


def commands(text: str) -> list[str]:
    """The commands of a Markdown text's ```bash blocks: continuation lines joined, comments and blank lines
    dropped.

    >>> commands("x\\n```bash\\nmake train   # runs it\\nls \\\\\\n  -l\\n```\\n```text\\nno\\n```\\n")
    ['make train', 'ls -l']
    """
    found = []
    for block in BASH_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(shlex.join(words))
    return found


def with_overrides(words: list[str], overrides: dict[str, str]) -> list[str]:
    """`words` with each `key=value` of `overrides` replacing the same key's word, or appended.

    >>> with_overrides(["gspo-train", "train.steps=100", "seed=1"], {"train.steps": "2", "sft.steps": "25"})
    ['gspo-train', 'train.steps=2', 'seed=1', 'sft.steps=25']
    """
    keys = {word.split("=", 1)[0].lstrip("+~"): i for i, word in enumerate(words) if "=" in word}
    words = list(words)
    for key, value in overrides.items():
        if key in keys:
            words[keys[key]] = f"{key}={value}"
        else:
            words.append(f"{key}={value}")
    return words


def tiny(command: str) -> str:
    """The command as it runs here: training shortened (`TINY`), `make test` on one file, the rest as written.

    >>> tiny("gspo-train -m algorithm=gspo,grpo seed=0,1,2 hydra.sweep.dir=multirun/first")  # doctest: +ELLIPSIS
    'gspo-train -m algorithm=gspo,grpo seed=0 hydra.sweep.dir=multirun/first train.steps=2 ...'
    """
    words = shlex.split(command)
    if words[:1] == ["gspo-train"]:
        multirun = "-m" in words or "--multirun" in words
        words = with_overrides(words, {**TINY, **(MULTIRUN_TINY if multirun else {})})
    elif words[:2] == ["make", "train"]:
        given = next((w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")), "")
        args = shlex.join(with_overrides(shlex.split(given), TINY))
        words = ["make", "train", f"ARGS={args}"]
    elif words[:2] == ["make", "test"]:
        words = ["make", "test", f"ARGS={TEST_TINY}"]
    return shlex.join(words)


def script(path: Path) -> str:
    """One bash script running a file's commands in order, each echoed before it runs."""
    lines = ["set -euo pipefail"]
    for command in map(tiny, commands(path.read_text())):
        lines += [f"echo {shlex.quote('$ ' + command)}", command]
    return "\n".join(lines) + "\n"


def fresh_clone(into: Path) -> Path:
    """A clone of this checkout's HEAD (what a newcomer gets), uncommitted changes left out."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(into)], check=True)
    return into


def newcomer_env(cache: Path) -> dict[str, str]:
    """This environment as a newcomer's shell has it: no virtual environment active (nor on PATH), no PYTHONPATH,
    an empty cold-start cache."""
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in Path(p).parts)
    return {**env, "GSPO_LAB_CACHE": str(cache)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--here", action="store_true", help="run in this checkout instead of a fresh clone")
    parser.add_argument("--list", action="store_true", help="print the commands as they will run, run nothing")
    args = parser.parse_args(argv)
    if args.list:
        for name in FILES:
            print(f"# {name}\n{script(ROOT / name)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="gspo-doc-commands-") as scratch:
        where = ROOT if args.here else fresh_clone(Path(scratch) / "gspo-lab")
        env = newcomer_env(cache=Path(scratch) / "cache")
        for name in FILES:
            print(f"== {name} (in {where})", flush=True)
            done = subprocess.run(["bash", "-c", script(where / name)], cwd=where, env=env)
            if done.returncode != 0:
                print(f"doc_commands: a command of {name} failed (exit {done.returncode}); the last one echoed "
                      "above is it", file=sys.stderr)
                return 1
    print("doc_commands: every command ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
