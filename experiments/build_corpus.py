"""The second corpus: the Python 3.11 documentation's reStructuredText sources, from Debian's ``python3.11-doc``.

    python experiments/build_corpus.py [--out experiments/corpora/python_docs.txt] [--deb FILE | --source-dir DIR]

Offline and reproducible: the package is fetched by pinned version with ``apt-get download`` (Debian's own
registry; ``--deb`` takes a downloaded ``.deb``), unpacked with ``dpkg-deb -x``, and every
``usr/share/doc/python3.11/html/_sources/**/*.rst.txt`` (English prose with code examples and reST markup, about
11 MB) is concatenated in the order of the sha256 of its relative path, so the 90/5/5 split of ``text_file`` mixes
documents of every kind instead of holding out one chapter. Writes the text and ``<out>.json`` (package, version,
the .deb's sha256, file count, bytes, the text's sha256); rebuilding gives the same sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "python3.11-doc"
VERSION = "3.11.2-6+deb12u9"
SOURCES = "usr/share/doc/python3.11/html/_sources"
PATTERN = "*.rst.txt"
DEFAULT_OUT = Path(__file__).resolve().parent / "corpora" / "python_docs.txt"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def collect(source_dir: Path) -> list[Path]:
    """The documents under ``source_dir``, in the order of the sha256 of their path relative to it."""
    files = [p for p in source_dir.rglob(PATTERN) if p.is_file()]
    if not files:
        raise ValueError(f"no {PATTERN} files under {source_dir}")
    return sorted(files, key=lambda p: hashlib.sha256(p.relative_to(source_dir).as_posix().encode()).hexdigest())


def build(source_dir: Path, out: Path, provenance: dict) -> dict:
    """Concatenates the documents (each followed by a blank line) into ``out``; returns the manifest it writes."""
    files = collect(source_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "wb") as f:
        for p in files:
            text = p.read_bytes()
            try:
                text.decode("utf-8")
            except UnicodeDecodeError as e:  # refuse it, naming it, rather than train on it
                raise ValueError(f"{p} is not UTF-8 ({e.reason} at byte {e.start}); allowed: UTF-8 text") from None
            f.write(text.rstrip(b"\n") + b"\n\n")
    tmp.replace(out)
    manifest = {**provenance, "files": len(files), "bytes": out.stat().st_size, "sha256": sha256_file(out)}
    out.with_suffix(out.suffix + ".json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def unpack(deb: Path, into: Path) -> Path:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    source_dir = into / SOURCES
    if not source_dir.is_dir():
        raise ValueError(f"{deb} holds no {SOURCES}: is it {PACKAGE}?")
    return source_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the text file (default {DEFAULT_OUT})")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--deb", type=Path, help=f"a downloaded {PACKAGE}_{VERSION}_all.deb")
    group.add_argument("--source-dir", type=Path, help=f"a folder of {PATTERN} files (an unpacked package)")
    args = p.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="qkvjax-corpus-") as tmp:
            if args.source_dir:
                if not args.source_dir.is_dir():
                    raise ValueError(f"--source-dir={args.source_dir}: not a folder")
                manifest = build(args.source_dir, args.out, {"source": str(args.source_dir)})
            else:
                deb = args.deb
                if deb is None:
                    download = ["apt-get", "download", f"{PACKAGE}={VERSION}"]
                    if subprocess.run(download, cwd=tmp).returncode != 0:
                        raise ValueError(
                            f"{' '.join(download)} failed: the package index may be stale (run `apt-get update` "
                            f"first) or the version no longer served (snapshot.debian.org keeps every version; "
                            f"--deb FILE takes a downloaded .deb)"
                        )
                    deb = next(Path(tmp).glob(f"{PACKAGE}_*.deb"))
                elif not deb.is_file():
                    raise ValueError(f"--deb={deb}: no such file")
                provenance = {"package": PACKAGE, "version": VERSION, "deb_sha256": sha256_file(deb)}
                manifest = build(unpack(deb, Path(tmp) / "x"), args.out, provenance)
    except (ValueError, subprocess.CalledProcessError) as e:
        print(f"build_corpus: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
