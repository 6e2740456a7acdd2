"""The byte corpora beyond Tiny Shakespeare, built offline and reproducibly from Debian packages (Debian's own
registry, pinned versions, checked by sha256).

    python experiments/build_corpus.py [--corpus python_docs|linux] [--out FILE] [--deb FILE | --source-dir DIR]

``python_docs`` (the default; the sweep's second corpus, about 11 MB): the Python 3.11 documentation's
reStructuredText sources from ``python3.11-doc``, every ``usr/share/doc/python3.11/html/_sources/**/*.rst.txt``.
``linux`` (128 MiB, for the larger sizes a GPU can train): the Linux 6.1 source tree from ``linux-source-6.1``
(the ``.tar.xz`` inside it), its ``Documentation/`` prose (reStructuredText and text) and the C of the core
subsystems (``kernel``, ``mm``, ``fs``, ``net``, ``lib``, ``block``, ``ipc``, ``security``, ``crypto``,
``init``), with ``drivers/`` and ``arch/`` left out: their register tables and per-device variants repeat.

Each package is fetched by pinned version with ``apt-get download`` (``--deb`` takes a downloaded ``.deb``) and
unpacked with ``dpkg-deb -x``; the chosen files are concatenated in the order of the sha256 of their relative
path (so the 90/5/5 split of ``text_file`` mixes documents of every kind instead of holding out one chapter), up
to the corpus' byte budget where it has one (the file that crosses it is the last). Writes the text and
``<out>.json`` (package, version, the .deb's sha256, file count, bytes, the text's sha256); rebuilding gives the
same sha256.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

CORPORA_DIR = Path(__file__).resolve().parent / "corpora"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One corpus: the package and version it comes from, the folder inside it (``tarball``: inside that archive
    of the package) and the files taken there (glob patterns), and the byte budget (None: everything)."""

    package: str
    version: str
    root: str
    patterns: tuple[str, ...]
    tarball: str | None = None
    max_bytes: int | None = None


CORE = ("kernel", "mm", "fs", "net", "lib", "block", "ipc", "security", "crypto", "init")
CORPORA = {
    "python_docs": Corpus(
        "python3.11-doc", "3.11.2-6+deb12u9", "usr/share/doc/python3.11/html/_sources", ("**/*.rst.txt",)
    ),  # fmt: skip
    "linux": Corpus(
        "linux-source-6.1",
        "6.1.192-2",
        "linux-source-6.1",
        ("Documentation/**/*.rst", "Documentation/**/*.txt", *(f"{d}/**/*.[ch]" for d in CORE)),
        tarball="usr/src/linux-source-6.1.tar.xz",
        max_bytes=128 << 20,
    ),  # fmt: skip
}
DEFAULT_OUT = CORPORA_DIR / "python_docs.txt"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def collect(source_dir: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The documents under ``source_dir`` matching any pattern, in the order of the sha256 of their path relative
    to it."""
    files = {p for pattern in patterns for p in source_dir.glob(pattern) if p.is_file()}
    if not files:
        raise ValueError(f"no {' or '.join(patterns)} files under {source_dir}")
    return sorted(files, key=lambda p: hashlib.sha256(p.relative_to(source_dir).as_posix().encode()).hexdigest())


def build(source_dir: Path, out: Path, provenance: dict, corpus: Corpus = CORPORA["python_docs"]) -> dict:
    """Concatenates the documents (each followed by a blank line) into ``out``, up to ``corpus.max_bytes``;
    returns the manifest it writes."""
    files = collect(source_dir, corpus.patterns)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    taken = 0
    with open(tmp, "wb") as f:
        for p in files:
            if corpus.max_bytes is not None and f.tell() >= corpus.max_bytes:
                break
            text = p.read_bytes()
            try:
                text.decode("utf-8")
            except UnicodeDecodeError as e:  # refuse it, naming it, rather than train on it
                raise ValueError(f"{p} is not UTF-8 ({e.reason} at byte {e.start}); allowed: UTF-8 text") from None
            f.write(text.rstrip(b"\n") + b"\n\n")
            taken += 1
    tmp.replace(out)
    manifest = {**provenance, "files": taken, "bytes": out.stat().st_size, "sha256": sha256_file(out)}
    out.with_suffix(out.suffix + ".json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def unpack(deb: Path, into: Path, corpus: Corpus) -> Path:
    """The package's ``corpus.root`` folder, unpacked under ``into`` (from the tarball inside it, if any)."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    if corpus.tarball:
        archive = into / corpus.tarball
        if not archive.is_file():
            raise ValueError(f"{deb} holds no {corpus.tarball}: is it {corpus.package}?")
        tops = {f"{corpus.root}/{pattern.split('/')[0]}" for pattern in corpus.patterns}  # the folders read
        with tarfile.open(archive) as tar:
            wanted = (m for m in tar if any(m.name == t or m.name.startswith(t + "/") for t in tops))
            tar.extractall(into / "tree", members=wanted, filter="data")  # "data": no links out, no devices
        into = into / "tree"
    source_dir = into / corpus.root
    if not source_dir.is_dir():
        raise ValueError(f"{deb} holds no {corpus.root}: is it {corpus.package}?")
    return source_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="python_docs", help=f"one of {', '.join(CORPORA)} (default python_docs)")
    p.add_argument("--out", type=Path, default=None, help=f"the text file (default {CORPORA_DIR}/<corpus>.txt)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--deb", type=Path, help="the corpus' package, downloaded (<package>_<version>_all.deb)")
    group.add_argument("--source-dir", type=Path, help="a folder holding the corpus' files (an unpacked package)")
    args = p.parse_args(argv)
    try:
        if args.corpus not in CORPORA:
            raise ValueError(f"--corpus={args.corpus!r}; allowed: {', '.join(CORPORA)}")
        corpus, out = CORPORA[args.corpus], args.out or CORPORA_DIR / f"{args.corpus}.txt"
        with tempfile.TemporaryDirectory(prefix="qkvjax-corpus-") as tmp:
            if args.source_dir:
                if not args.source_dir.is_dir():
                    raise ValueError(f"--source-dir={args.source_dir}: not a folder")
                manifest = build(args.source_dir, out, {"source": str(args.source_dir)}, corpus)
            else:
                deb = args.deb
                if deb is None:
                    download = ["apt-get", "download", f"{corpus.package}={corpus.version}"]
                    if subprocess.run(download, cwd=tmp).returncode != 0:
                        raise ValueError(
                            f"{' '.join(download)} failed: the package index may be stale (run `apt-get update` "
                            f"first) or the version no longer served (snapshot.debian.org keeps every version; "
                            f"--deb FILE takes a downloaded .deb)"
                        )
                    deb = next(Path(tmp).glob(f"{corpus.package}_*.deb"))
                elif not deb.is_file():
                    raise ValueError(f"--deb={deb}: no such file")
                provenance = {"package": corpus.package, "version": corpus.version, "deb_sha256": sha256_file(deb)}
                manifest = build(unpack(deb, Path(tmp) / "x", corpus), out, provenance, corpus)
    except (ValueError, subprocess.CalledProcessError, tarfile.TarError) as e:
        print(f"build_corpus: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
