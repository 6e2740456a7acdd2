"""Results files shared by the experiments: CSV rows appended one finished run at a time, flushed and fsynced, so a
kill, a full disk or a power cut never leaves half a row behind a good one (a row a kill cut is skipped by the readers
and truncated before the next append), and a rerun resumes from what is there.

    read_csv(path)                      the rows so far ([] when the file is absent)
    append_rows(path, columns, rows)    one finished run's rows (the header first, if the file is new; a file
                                        written before columns were added at the end is rewritten with them)
    replace_rows(path, columns, rows)   the whole file, written beside it and renamed into place
    write_json(path, value)             a JSON record (protocol.json, probe.json), the same way
    blank(value)                        a CSV cell ('' for None)
    PROTOCOL_FILE                       the name of a results folder's record of the settings that made it

and the command-line values every sweep takes: ``csv_list(kind)`` (``--seeds 0,1,2``) and ``rows_file``/``row_spec``
(``--row NAME=KEY=VALUE;...``, a model per row).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
from pathlib import Path

PROTOCOL_FILE = "protocol.json"


def read_csv(path: Path) -> list[dict]:
    """The complete rows: a last line without its line end is a row another process is still appending (or one
    a kill cut), taken once it is whole, never half."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        text = f.read()
    return list(csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])))


def _drop_cut_line(path: Path) -> None:
    """Truncates a last line without its line end: a row (or header) a kill cut while it was being appended.
    ``append_rows`` calls it before writing: a file has one writer at a time, so the line cannot be one still being
    written, and appending after it would glue the next row onto the half one."""
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return  # ends whole, the usual case: one byte read, not the file
        f.seek(0)
        f.truncate(f.read().rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


def append_rows(path: Path, columns, rows: list[dict]) -> None:
    if path.exists():
        _drop_cut_line(path)
    new = not path.exists() or path.stat().st_size == 0  # absent, or only a cut header
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != list(columns):
            if header != list(columns)[: len(header)]:
                raise ValueError(f"{path} has columns {header}; allowed: {list(columns)} or a leading part of them")
            replace_rows(path, columns, read_csv(path))  # columns added since: the old rows' new cells blank
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def replace_rows(path: Path, columns, rows: list[dict]) -> None:
    def write(f) -> None:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    _replace(path, write)


def write_json(path: Path, value) -> None:
    """``value`` as indented JSON: a kill or a full disk while writing leaves the earlier record whole (a resumed
    sweep reads it first, and an empty one stopped it)."""
    _replace(path, lambda f: f.write(json.dumps(value, indent=2) + "\n"))


def _replace(path: Path, write) -> None:
    """``write(file)`` into a temporary sibling, flushed to disk, renamed over ``path``; removed if it fails. One
    name per file (one writer at a time): what a kill leaves is overwritten by the next write, never piled up."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", newline="") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def blank(value):
    """A CSV cell: '' for None."""
    return "" if value is None else value


def csv_list(kind):
    """An argparse type: a comma-separated list of ``kind`` (int, float or str)."""

    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if kind in (int, float):
            try:
                return [kind(x) for x in items]
            except ValueError:
                what = f"a comma-separated list of {kind.__name__}s"
                raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        return items

    return parse


def row_spec(text: str) -> tuple[str, dict[str, str]]:
    """``NAME=KEY=VALUE;KEY=VALUE`` -> (NAME, {KEY: VALUE}); ``NAME=`` is the base config itself."""
    name, _, rest = text.partition("=")
    if not name.strip() or not name.replace("_", "").replace("-", "").isalnum():
        raise argparse.ArgumentTypeError(f"--row {text!r}: NAME=KEY=VALUE;...; allowed names: letters, digits, _ -")
    overrides = {}
    for item in (x.strip() for x in rest.split(";") if x.strip()):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"--row {name}: {item!r} is not KEY=VALUE (e.g. model.layers=...)")
        overrides[key.strip().removeprefix("--config.")] = value.strip()
    return name.strip(), overrides


def rows_file(path: str) -> list[tuple[str, dict[str, str]]]:
    """An argparse type: a file of ``NAME=KEY=VALUE;...`` lines (``#`` comments), each parsed by :func:`row_spec`."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"--rows {path!r}: {e.strerror}; allowed: a text file of NAME=KEY=VALUE;..."
        ) from None
    return [row_spec(line.split("#", 1)[0].strip()) for line in lines if line.split("#", 1)[0].strip()]
