"""Results files shared by the experiments: CSV rows appended one finished run at a time, flushed and fsynced, so a
kill, a full disk or a power cut never leaves half a row behind a good one, and a rerun resumes from what is there.

    read_csv(path)                      the rows so far ([] when the file is absent)
    append_rows(path, columns, rows)    one finished run's rows (the header first, if the file is new)
    replace_rows(path, columns, rows)   the whole file, written beside it and renamed into place
"""

from __future__ import annotations

import csv
import os
from pathlib import Path


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def append_rows(path: Path, columns, rows: list[dict]) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())


def replace_rows(path: Path, columns, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
