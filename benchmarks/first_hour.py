"""Times README.md's fresh-machine run command and its "first hour" block, command by command, as a user runs them.

    python benchmarks/first_hour.py --out benchmarks/results/first_hour_cpu.json [--replace OLD=NEW ...]

Runs in a scratch folder that looks like a fresh clone with ``../shared`` beside it (links to this checkout's
``experiments/``, ``README.md``, ``.venv`` and the shared corpus), so nothing in the checkout is touched. Prints a
table of wall-clock seconds per command and writes it as JSON with the machine and date. ``--replace`` edits every
command before it runs; tests/test_readme.py uses the same parsing with the tiny preset.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_blocks(text: str) -> dict[str, list[str]]:
    """The README's commands a user runs: ``run`` (the fresh-machine run command without its install part),
    ``first_hour`` (the lines of the block after the ``first-hour`` marker) and ``tensorboard``."""
    blocks = {}
    for name in ("first-hour", "tensorboard"):
        m = re.search(rf"<!-- {name}:.*?-->\s*```bash\n(.*?)```", text, re.S)
        if m is None:
            raise ValueError(f"README.md has no ```bash block after a <!-- {name}: ... --> marker")
        blocks[name.replace("-", "_")] = [line for line in m.group(1).splitlines() if line.strip()]
    m = re.search(r"## (?:Install and the two commands|Fresh machine).*?```bash\n(.*?)\n```", text, re.S)
    if m is None:
        raise ValueError("README.md has no fresh-machine run command")
    blocks["run"] = [m.group(1).split(" && ")[-1]]  # after `python3 -m venv .venv && .venv/bin/pip install ...`
    return blocks


def fresh_clone(root: Path, venv: Path, shared: Path) -> Path:
    """``root/clone`` with links standing for a fresh clone, and ``root/shared``; returns the clone."""
    clone = root / "clone"
    clone.mkdir(parents=True)
    for name in ("experiments", "README.md"):
        (clone / name).symlink_to(REPO / name)
    (clone / ".venv").symlink_to(venv)
    (root / "shared").symlink_to(shared)
    return clone


def apply(command: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        command = command.replace(old, new)
    return command


def run_commands(commands: list[str], cwd: Path, env: dict | None = None, log=None) -> list[dict]:
    """Runs each command with bash in ``cwd``, in one shell session (``source`` carries over); returns
    [{command, seconds, returncode}] and stops at the first failure."""
    rows = []
    prelude = []
    for command in commands:
        script = "\n".join(["set -eo pipefail", *prelude, command])
        start = time.perf_counter()
        proc = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True)
        seconds = round(time.perf_counter() - start, 1)
        rows.append({"command": command, "seconds": seconds, "returncode": proc.returncode,
                     "stdout": proc.stdout, "stderr": proc.stderr})  # fmt: skip
        if log:
            log(f"{rows[-1]['seconds']:8.1f}s  rc {proc.returncode}  {command[:100]}")
        if proc.returncode:
            break
        if command.startswith("source "):
            prelude.append(command)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the timings here as JSON")
    parser.add_argument("--replace", action="append", default=[], metavar="OLD=NEW", help="edit every command")
    parser.add_argument("--venv", default=str(REPO / ".venv"), help="the installed venv to link as .venv")
    parser.add_argument("--shared", default=str(REPO.parent / "shared"), help="the folder standing for ../shared")
    args = parser.parse_args(argv)
    replacements = [tuple(r.split("=", 1)) for r in args.replace]
    blocks = readme_blocks((REPO / "README.md").read_text())
    commands = [apply(c, replacements) for c in blocks["run"] + blocks["first_hour"]]
    with tempfile.TemporaryDirectory(prefix="qkvjax-first-hour-") as tmp:
        clone = fresh_clone(Path(tmp), Path(args.venv), Path(args.shared))
        rows = run_commands(commands, clone, log=print)
    failed = [r for r in rows if r["returncode"]]
    if failed:
        print(failed[0]["stdout"][-2000:], failed[0]["stderr"][-2000:], file=sys.stderr)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} cpus",
        "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "total_s": round(sum(r["seconds"] for r in rows), 1),
        "rows": [{k: r[k] for k in ("command", "seconds", "returncode")} for r in rows],
    }
    print(f"total {result['total_s']:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
