"""The kernel plan scripts/setup.sh prints: what each layer type will run on a GPU, from the same
dispatch state the layers use (stand-in kernels here; on CPU: SDPA and the PyTorch scan)."""
import pytest

from fpscale.ops import attention, kernel_plan, kernels, scan_kernels

SENTINEL = object()


@pytest.fixture
def installed(monkeypatch):
    """Set which optional kernels import: installed(flash=True, mamba=False, triton=True)."""
    def set_(flash=False, mamba=False, triton=False, broken=None):
        monkeypatch.setattr(attention, "FLASH_ATTN", SENTINEL if flash else None)
        monkeypatch.setattr(attention, "FLASH_ATTN_ERROR", broken)
        monkeypatch.setattr(scan_kernels, "MAMBA_SCAN", SENTINEL if mamba else None)
        monkeypatch.setattr(scan_kernels, "MAMBA_SCAN_ERROR", None)
        monkeypatch.setattr(scan_kernels, "TRITON_SCAN", SENTINEL if triton else None)
        monkeypatch.setattr(scan_kernels, "TRITON_SCAN_ERROR", None)
    for switch in ("FPSCALE_FLASH_ATTN", "FPSCALE_MAMBA_SCAN", "FPSCALE_TRITON_SCAN"):
        monkeypatch.delenv(switch, raising=False)
    return set_


def test_a_pypi_only_gpu_machine_runs_sdpa_and_the_triton_scan(installed):
    installed(triton=True)
    assert kernel_plan.plan(cuda=True) == {kernel_plan.ATTENTION: "SDPA (its flash/cuDNN backends in bf16)",
                                       "fpmamba scan": "Triton", "fpmamba2 scan": kernel_plan.FPMAMBA2_CUDA}


def test_the_optional_kernels_come_first_where_installed(installed):
    installed(flash=True, mamba=True, triton=True)
    assert kernel_plan.plan(cuda=True) == {kernel_plan.ATTENTION: "flash-attn",
                                           "fpmamba scan": "mamba-ssm (decoding: Triton)",
                                           "fpmamba2 scan": kernel_plan.FPMAMBA2_CUDA}


def test_switches_and_failures_are_named(installed, monkeypatch):
    installed(flash=False, mamba=True, triton=False, broken=OSError("undefined symbol"))
    plan = kernel_plan.plan(cuda=True)
    assert plan[kernel_plan.ATTENTION].startswith("flash-attn fails to import (OSError('undefined symbol')")
    assert "FPSCALE_FLASH_ATTN=0" in plan[kernel_plan.ATTENTION]
    assert plan["fpmamba scan"].startswith("mamba-ssm (decoding: PyTorch (chunked: about 400 launches")
    monkeypatch.setenv("FPSCALE_MAMBA_SCAN", "0")
    monkeypatch.setenv("FPSCALE_FLASH_ATTN", "0")
    plan = kernel_plan.plan(cuda=True)
    assert plan["fpmamba scan"].startswith("PyTorch (chunked") and plan[kernel_plan.ATTENTION].startswith("SDPA")


def test_on_cpu():
    assert kernel_plan.plan(cuda=False) == {kernel_plan.ATTENTION: "SDPA", "fpmamba scan": "PyTorch (chunked)",
                                            "fpmamba2 scan": "PyTorch (chunked SSD)"}
    assert kernel_plan.describe().startswith("kernels on cpu: attention (attn, fpsa, looped")


def test_the_counter():
    kernels.reset()
    kernels.ran("attention", "sdpa bf16")
    kernels.ran("attention", "sdpa bf16")
    kernels.ran("scan", "triton")
    assert kernels.used() == {"attention": {"sdpa bf16": 2}, "scan": {"triton": 1}}
    assert kernels.summary() == "attention: sdpa bf16 x2; scan: triton x1"
    kernels.reset()
    assert kernels.summary() == "-"
