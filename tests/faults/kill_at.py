"""Runs the qkvjax CLI and SIGKILLs it at its Nth file boundary: the Nth time it creates a folder, opens a file
for writing, renames or removes one (Python's audit events ``os.mkdir``, ``open`` with a write mode,
``os.rename``, ``os.replace``, ``os.remove``, ``shutil.rmtree``). Exits 0 having run to the end if there are fewer
than N boundaries.

    python tests/faults/kill_at.py N import FOLDER --workdir W
    python tests/faults/kill_at.py publish convert ...     # at the rename that publishes a ``.NAME.partial.*`` folder

Writes made by native code (orbax's TensorStore, safetensors' Rust writer) are not seen one by one, only the
Python boundaries around them: every folder and file these tools name themselves.
"""

import os
import signal
import sys

EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "shutil.rmtree"}
WRITE_MODES = ("w", "a", "x", "+")


def main() -> int:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print("usage: python tests/faults/kill_at.py N|publish QKVJAX_COMMAND [ARGS...]\n\n" + __doc__)
        return 0
    if len(sys.argv) < 3 or not (sys.argv[1] == "publish" or sys.argv[1].isdigit() and int(sys.argv[1]) > 0):
        got = sys.argv[1] if len(sys.argv) > 1 else "nothing"
        print(f"kill_at: error: the first argument is {got!r}; allowed: a boundary number N >= 1 or 'publish', "
              "then the qkvjax command", file=sys.stderr)  # fmt: skip
        return 2
    from qkvjax.cli import main as cli

    install(sys.argv[1])  # after the import, whose own writes (bytecode caches) are no boundary of the command
    return cli(sys.argv[2:])


def install(at: str, echo: bool = False) -> None:
    """Adds the audit hook that SIGKILLs this process at boundary ``at`` (a number; 0 never) or at the publishing
    rename (``"publish"``); with ``echo`` each boundary is printed as ``N<TAB>event<TAB>arg<TAB>arg``."""
    publish = at == "publish"
    n = 0 if publish else int(at)
    seen = 0

    def hook(event, args):
        nonlocal seen
        if event == "open":
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writes = any(m in mode for m in WRITE_MODES) or flags & (os.O_WRONLY | os.O_RDWR)
            if not writes:
                return
        elif event not in EVENTS:
            return
        seen += 1
        if echo:
            print(seen, event, *(str(a) for a in args[:2]), sep="\t", flush=True)
        published = event == "os.rename" and ".partial." in os.path.basename(str(args[0]))
        if seen == n or (publish and published):
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


if __name__ == "__main__":
    sys.exit(main())
