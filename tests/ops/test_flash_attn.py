"""flash-attn is an optional fast path: absent, attention runs on SDPA in silence; installed but
broken (a build for another CUDA or torch), it is an error that says so, not a silent fallback."""
import sys
from types import SimpleNamespace

import pytest
import torch

from fpscale.ops import attention


def test_an_absent_flash_attn_is_quietly_sdpa(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)          # import flash_attn -> ModuleNotFoundError
    assert attention.load_flash_attn() == (None, None)


def test_a_broken_flash_attn_install_is_reported_not_swallowed(tmp_path, monkeypatch):
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('flash_attn_2_cuda.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    fn, error = attention.load_flash_attn()
    assert fn is None and isinstance(error, OSError)

    monkeypatch.setattr(attention, "FLASH_ATTN", None)
    monkeypatch.setattr(attention, "FLASH_ATTN_ERROR", error)
    gpu_query = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"flash-attn is wanted on this GPU but it fails to import: "
                                           r"OSError.*undefined symbol.*FPSCALE_FLASH_ATTN=0"):
        attention.flash_attn_for(gpu_query)
    monkeypatch.setenv("FPSCALE_FLASH_ATTN", "0")                # the user's explicit choice of SDPA
    assert attention.flash_attn_for(gpu_query) is None
    monkeypatch.setenv("FPSCALE_FLASH_ATTN", "auto")
    assert attention.flash_attn_for(SimpleNamespace(is_cuda=False, dtype=torch.bfloat16)) is None   # CPU: SDPA


def test_required_flash_attn_that_is_absent_is_an_error(monkeypatch):
    monkeypatch.setattr(attention, "FLASH_ATTN", None)
    monkeypatch.setattr(attention, "FLASH_ATTN_ERROR", None)
    monkeypatch.setenv("FPSCALE_FLASH_ATTN", "1")
    with pytest.raises(RuntimeError, match="it is not installed"):
        attention.flash_attn_for(SimpleNamespace(is_cuda=True, dtype=torch.float16))
    monkeypatch.setenv("FPSCALE_FLASH_ATTN", "yes")
    with pytest.raises(ValueError, match="FPSCALE_FLASH_ATTN must be auto, 0 or 1, got 'yes'"):
        attention.flash_attn_for(SimpleNamespace(is_cuda=True, dtype=torch.float16))
