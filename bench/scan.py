"""FP-Mamba's selective scan, each implementation alone at the 125m_fpmamba geometry (configs/
125m_fpmamba.yaml: micro-batch 4, T 2048, d_inner = expand * d_model = 1536, d_state 16): time of
the forward (inputs requiring grad, as in training) and of forward + backward, the bytes saved for
backward, and the kernel launches per scan call.

    python bench/scan.py                          # on a GPU: pytorch, triton, mamba-ssm where installed
    python bench/scan.py --device cpu --repeats 1 # on CPU only the PyTorch scan runs; the others say why

Also the achieved memory bandwidth of each scan: the least bytes it can move (every input read once, every
output written once, ``min_bytes``) over its time, in GB/s and as a share of the GPU's HBM bandwidth
(``BANDWIDTH_GBS`` by device name, or ``--bandwidth-gbs``): a scan is memory-bound, so this is its roofline.

The scans: ``pytorch`` (fpscale.ops.scan.selective_scan, chunked), ``triton``
(fpscale.ops.scan_triton, one kernel forward and one backward), ``mamba-ssm`` (its
``selective_scan_fn``, called as fpscale.ops.scan_kernels calls it). A kernel that needs a GPU
says so on CPU rather than running (Triton's interpreter would take hours at this size).

Launches are counted, not estimated, in one extra call outside the timing: every ATen op that
launches work (views and allocations excluded) by a TorchDispatchMode, plus every Triton kernel
launch by triton's launch hook. The count does not depend on the device, so the PyTorch scan's
launches on CPU are the ones it makes on a GPU. mamba-ssm's own CUDA kernels (one forward, one
backward) go through its extension, which the mode does not see: its count is its ATen ops, marked
``+ext``. On a GPU every time is taken between two ``torch.cuda.synchronize()``; the time is the
median over ``--repeats`` after a warm-up call.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from common import print_table, write_json
from torch.utils._python_dispatch import TorchDispatchMode

from fpscale.ops import scan_kernels, scan_triton
from fpscale.ops.scan import selective_scan
from fpscale.profiling import count_saved_bytes

ROOT = Path(__file__).resolve().parents[1]
# HBM bandwidth (GB/s) by device name, from the vendors' data sheets (SXM parts; --bandwidth-gbs for others)
BANDWIDTH_GBS = {"H200": 4800, "H100": 3350, "A100-SXM4-80GB": 2039, "A100 80GB": 2039, "A100": 1555, "L40S": 864,
                 "L4": 300}


def peak_bandwidth(device: torch.device, given: float | None) -> float | None:
    if given:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbs for key, gbs in BANDWIDTH_GBS.items() if key in name), None)


def min_bytes(geo: dict, element: int) -> tuple[int, int]:
    """The least a scan can move (forward; forward + backward): each input read once and each output written
    once. Forward: x, dt [B, T, c], B, C [B, T, n], A [c, n] in, y [B, T, c] out. Backward: those inputs and
    gy in again, their five gradients out (a kernel that recomputes h from checkpoints reads no more)."""
    bt, c, n = geo["B"] * geo["T"], geo["d_inner"], geo["d_state"]
    inputs = (2 * bt * c + 2 * bt * n + c * n) * element
    fwd = inputs + bt * c * element
    bwd = inputs + bt * c * element + inputs
    return fwd, fwd + bwd
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
             "resize_", "set_"}


def triton_launch_hooks():
    """triton's chain of launch hooks (triton >= 3.4), or None."""
    knobs = getattr(scan_triton.triton, "knobs", None) if scan_triton.AVAILABLE else None
    return None if knobs is None else knobs.runtime.launch_enter_hook


class CountLaunches(TorchDispatchMode):
    """ATen ops that launch work (not views, not allocations), and Triton kernel launches."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def _triton_launch(self, *args, **kwargs):
        self.triton += 1

    def __enter__(self):
        hooks = triton_launch_hooks()
        if hooks is not None:
            hooks.add(self._triton_launch)
        elif scan_triton.AVAILABLE:                          # triton < 3.4: one hook, on CompiledKernel
            scan_triton.triton.compiler.CompiledKernel.launch_enter_hook = self._triton_launch
        return super().__enter__()

    def __exit__(self, *exc):
        hooks = triton_launch_hooks()
        if hooks is not None:
            hooks.remove(self._triton_launch)
        elif scan_triton.AVAILABLE:
            scan_triton.triton.compiler.CompiledKernel.launch_enter_hook = None
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + self.triton


def mamba_ssm_scan(x, dt, A, B, C):
    y, last = scan_kernels.MAMBA_SCAN(*(t.transpose(1, 2).contiguous() for t in (x, dt)), A.contiguous(),
                                      *(t.transpose(1, 2).contiguous() for t in (B, C)), return_last_state=True)
    return y.transpose(1, 2), last


def scans(device: torch.device) -> dict:
    """name -> (the scan, or None, and why it does not run here)."""
    out = {"pytorch": (selective_scan, None)}
    why = scan_triton.runnable(torch.empty(0, device=device))
    if device.type != "cuda":
        why = "needs a GPU (on CPU only Triton's interpreter runs it, far too slowly at this size)" + (
            "" if scan_triton.AVAILABLE else "; triton is not installed")
    out["triton"] = (None, why) if why else (scan_triton.triton_selective_scan, None)
    if scan_kernels.MAMBA_SCAN_ERROR is not None:
        out["mamba-ssm"] = (None, f"fails to import: {scan_kernels.MAMBA_SCAN_ERROR!r}")
    elif scan_kernels.MAMBA_SCAN is None:
        out["mamba-ssm"] = (None, "not installed" + ("" if device.type == "cuda" else "; needs a GPU"))
    elif device.type != "cuda":
        out["mamba-ssm"] = (None, "needs a GPU")
    else:
        out["mamba-ssm"] = (mamba_ssm_scan, None)
    return out


def geometry(args) -> dict:
    cfg = yaml.safe_load((ROOT / args.config).read_text())
    layer = cfg["model"]["layers"][0]
    geo = {"B": cfg["train"]["micro_batch"], "T": cfg["data"]["seq_len"],
           "d_inner": layer.get("expand", 2) * cfg["model"]["d_model"], "d_state": layer.get("d_state", 16)}
    for key in geo:
        if getattr(args, key) is not None:
            geo[key] = getattr(args, key)
    return geo


def make_inputs(geo: dict, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """As the layer makes them: dt = softplus(.) > 0, A = -exp(.) < 0."""
    g = torch.Generator().manual_seed(0)
    Bsz, T, c, n = geo["B"], geo["T"], geo["d_inner"], geo["d_state"]
    x = torch.randn(Bsz, T, c, generator=g)
    dt = F.softplus(torch.randn(Bsz, T, c, generator=g) - 2)
    A = -torch.exp(0.5 * torch.randn(c, n, generator=g))
    B, C = torch.randn(Bsz, T, n, generator=g), torch.randn(Bsz, T, n, generator=g)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (x, dt, A, B, C)]


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure(fn, leaves, weight, device, repeats: int) -> dict:
    def forward():
        return fn(*leaves)[0]

    def step():
        torch.autograd.grad((forward() * weight).sum(), leaves)

    step()                                                   # warm-up (Triton compiles here)
    fwd, both = [], []
    for _ in range(repeats):
        t0 = clock(device)
        y = forward()
        t1 = clock(device)
        del y
        step()
        t2 = clock(device)
        fwd.append(t1 - t0)
        both.append(t2 - t1)
    with count_saved_bytes(exclude=tuple(leaves)) as saved:
        y = forward()
    with CountLaunches() as count_fwd:
        y = forward()
    with CountLaunches() as count_bwd:
        torch.autograd.grad((y * weight).sum(), leaves)
    return {"fwd_ms": 1e3 * statistics.median(fwd), "fwd_bwd_ms": 1e3 * statistics.median(both),
            "saved_MiB": saved.total / 2 ** 20, "launches_fwd": count_fwd.total,
            "launches_fwd_bwd": count_fwd.total + count_bwd.total, "top_ops": dict(count_fwd.ops.most_common(4))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/125m_fpmamba.yaml", help="the geometry's source")
    ap.add_argument("--B", type=int, default=None, help="default: the config's train.micro_batch")
    ap.add_argument("--T", type=int, default=None, help="default: the config's data.seq_len")
    ap.add_argument("--d-inner", dest="d_inner", type=int, default=None, help="default: expand * d_model")
    ap.add_argument("--d-state", dest="d_state", type=int, default=None)
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES),
                    help="the layer runs its scan in fp32 (fpscale.solvers.precision)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="the device's memory bandwidth (GB/s) for the *_of_peak columns (default: by GPU name)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    geo = geometry(args)
    peak = peak_bandwidth(device, args.bandwidth_gbs)
    rows = []
    for name in args.dtypes:
        leaves = make_inputs(geo, DTYPES[name], device)
        weight = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(1)).to(device, DTYPES[name])
        base = None
        for scan, (fn, why) in scans(device).items():
            row = {"scan": scan, "dtype": name}
            if fn is None:
                row["note"] = why
            else:
                row.update(measure(fn, leaves, weight, device, args.repeats))
                if scan == "mamba-ssm":
                    row["note"] = "launches: its ATen ops, +ext (its own CUDA kernels)"
                if scan == "triton":       # the forward's block sizes, autotuned for this (d_inner, d_state)
                    best = scan_triton._scan_fwd_tuned.best_config
                    row["note"] = f"forward tuned: BLOCK_C {best.kwargs['BLOCK_C']}, {best.num_warps} warps"
                base = row["fwd_bwd_ms"] if scan == "pytorch" else base
                row["x_pytorch"] = base / row["fwd_bwd_ms"] if base else None
                fwd_bytes, both_bytes = min_bytes(geo, leaves[0].element_size())
                row["fwd_GBs"] = fwd_bytes / row["fwd_ms"] / 1e6
                row["fwd_bwd_GBs"] = both_bytes / row["fwd_bwd_ms"] / 1e6
                if peak:
                    row["fwd_of_peak"], row["fwd_bwd_of_peak"] = row["fwd_GBs"] / peak, row["fwd_bwd_GBs"] / peak
            rows.append(row)
    print(f"selective scan at B={geo['B']} T={geo['T']} d_inner={geo['d_inner']} d_state={geo['d_state']} on {device} "
          f"({args.config}), median of {args.repeats}")
    print_table(rows, ["scan", "dtype", "fwd_ms", "fwd_bwd_ms", "x_pytorch", "saved_MiB", "launches_fwd",
                       "launches_fwd_bwd", "note"])
    print(f"\nachieved memory bandwidth: the least bytes a scan moves / its time (forward; forward + backward), "
          f"against the device's {f'{peak:,.0f} GB/s' if peak else 'bandwidth (unknown: --bandwidth-gbs)'}")
    print_table([r for r in rows if "fwd_GBs" in r], ["scan", "dtype", "fwd_GBs", "fwd_of_peak", "fwd_bwd_GBs",
                                                       "fwd_bwd_of_peak"])
    write_json("scan", {"args": vars(args), "geometry": geo, "peak_bandwidth_GBs": peak, "rows": rows}, args.out)
    return rows


if __name__ == "__main__":
    main()
