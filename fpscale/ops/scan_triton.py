"""FP-Mamba's selective scan as two Triton kernels (forward, backward): one launch each on a GPU,
where the chunked PyTorch scan (fpscale.ops.scan) launches about 400 small kernels per call at
T = 2048.

    h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t^T        per channel c and state n (A <= 0, dt >= 0)
    y_t = h_t C_t                                       y_t[c] = sum_n h_t[c, n] C_t[n]

``triton_selective_scan(x, dt, A, B, C, h0)`` has ``selective_scan``'s contract: x, dt [B, T, c];
A [c, n] (<= 0); B, C [B, T, n]; h0 [B, c, n] or None; it returns y [B, T, c] and the last state
[B, c, n] (not differentiable: the decode cache), both in the inputs' dtype (float32, bfloat16 or
float16, all alike, as the PyTorch scan wants them), and differentiates x, dt, A, B, C and h0.

Design. The grid is (batch, blocks of ``block_c`` channels). A program keeps its [block_c, n]
state in registers, in float32 whatever the input dtype (n padded to a power of two, masked), and
loops over t; exp(dt A) is exp2(dt A log2 e), an exponent <= 0, so nothing overflows for any decay.
Positions past T (the last chunk's tail) and padded channels or states load dt = x = B = C = 0: the
decay is 1 and the input 0 there, so the state is held and nothing is added (no branch in the loop).
  forward   y at every step (contracted with C in registers, stored in the input dtype), the last
            state, and, when a gradient is wanted, the state at the start of every chunk of
            ``chunk`` steps (checkpoints, float32).
  backward  the chunks right to left: the chunk's states are recomputed forward from its checkpoint
            into a per-program scratch buffer (float32, [chunk + 1, block_c, n]), then the adjoint
            lambda_t = C_t g_t + a_{t+1} lambda_{t+1} runs back through the chunk with
              dL/d(dt A)_t = lambda_t a_t h_{t-1}     -> dt (sum over n, times A) and A (times dt)
              dL/dw_t      = sum_n lambda_t B_t       -> x (times dt) and dt (times x), w = dt x
              dL/dB_t      = sum_c lambda_t w_t,   dL/dC_t = sum_c h_t g_t
            and a_0 lambda_0 is the gradient of h0. dx and ddt belong to one program (its channels
            and batch row) and are stored directly. dA, dB and dC are sums over programs: each
            program writes its own partial sums (dA per batch row [B, c, n], dB and dC per channel
            block [B, c / block_c, T, n], float32) and PyTorch sums them after the kernel. No
            atomics, so the gradients are deterministic.
Saved for backward: the inputs themselves (references, no copies; strided views are read in place)
and the checkpoints, 4 B ceil(T / chunk) c n bytes: 24 MiB at the 125m_fpmamba geometry (B 8,
T 2048, c 1536, n 16, chunk 64), against 96 MiB of chunk starts for the PyTorch scan (chunk 16) and
1.5 GiB for the state of every step. The backward's
scratch is 4 B (c / block_c) (chunk + 1) block_c n' bytes (n' = n padded), freed after it.
Each step loop is software-pipelined (``tl.range(..., num_stages=STAGES)``: the next steps' loads are in
flight while one step computes), and a sequence shorter than the chunk runs a chunk of the next power of
two (decoding: one step, not 64). The forward's block_c and warps are tuned per (d_inner, d_state) by
``triton.autotune`` on first use (``FWD_CONFIGS``, those whose state fits the registers; under the
interpreter each config runs once and the tests hold every one to the reference); the backward's (block_c
32), the chunk (64) and the stages (3) are untuned defaults. At block_c 32, compiled ahead of time for
sm_80 and sm_90 (Triton 3.9, ptxas), the kernels take 48-56 registers forward and 116-128 backward without
spills up to d_state 128 (the other forward configs are unchecked there); the tuning has not run on a GPU yet.

Triton is optional: without it this module imports and ``TRITON_SCAN_ERROR`` says why (None when
triton is not installed, the exception when it is installed but does not import, as
``fpscale.ops.attention.load_optional``). The kernels run on CUDA tensors; on CPU tensors only under
Triton's interpreter, which must be on (``TRITON_INTERPRET=1``) when this module is first imported
(triton decides per kernel at its definition): ``INTERPRET`` records it. ``fpscale.ops.scan_kernels``
dispatches to this scan (``FPSCALE_TRITON_SCAN``). The tests hold it to the float64 reference under
the interpreter (tests/ops/test_scan_triton.py runs them in a child process with
``TRITON_INTERPRET=1``):

    python -m pytest tests/ops/test_scan_triton.py -q
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch.autograd.function import once_differentiable

from fpscale.ops.attention import load_optional

DEFAULT_CHUNK = 64
DEFAULT_BLOCK_C = 32
MAX_D_STATE = 128          # the state of a program lives in registers: [block_c, n] (256 spills in the backward)
STAGES = 3                 # software pipelining of each step loop's loads (tl.range num_stages)
# the forward's (BLOCK_C, warps) tried by triton.autotune per (d_inner, d_state): block_c=None
FWD_CONFIGS = ((16, 2), (32, 4), (64, 4), (64, 8), (128, 8))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634

_jit, TRITON_SCAN_ERROR = load_optional("triton", "jit")
AVAILABLE = _jit is not None
INTERPRET = False

if AVAILABLE:
    import triton
    import triton.language as tl


    @triton.jit
    def _scan_fwd(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, h0_ptr, y_ptr, last_ptr, ckpt_ptr,
                  sxb, sxt, sxc, sdb, sdt, sdc, sBb, sBt, sBn, sCb, sCt, sCn,
                  T, c, n, n_chunks,
                  HAS_H0: tl.constexpr, SAVE: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_n = tl.arange(0, BLOCK_N)
        mask_c, mask_n = offs_c < c, offs_n < n
        mask_cn = mask_c[:, None] & mask_n[None, :]
        cn = offs_c[:, None] * n + offs_n[None, :]                    # [c, n], contiguous
        A2 = tl.load(A_ptr + cn, mask=mask_cn, other=0.0).to(tl.float32) * 1.4426950408889634
        if HAS_H0:
            h = tl.load(h0_ptr + b * c * n + cn, mask=mask_cn, other=0.0).to(tl.float32)
        else:
            h = tl.zeros([BLOCK_C, BLOCK_N], dtype=tl.float32)
        x_row, dt_row = x_ptr + b * sxb + offs_c * sxc, dt_ptr + b * sdb + offs_c * sdc
        B_row, C_row = B_ptr + b * sBb + offs_n * sBn, C_ptr + b * sCb + offs_n * sCn
        y_row = y_ptr + b * T * c + offs_c
        # (a position's mask is built as a vector, offs * 0 + t < T: Triton's interpreter rejects a
        # vector mask and-ed with a scalar one)
        for k in range(n_chunks):
            if SAVE:
                tl.store(ckpt_ptr + (b * n_chunks + k) * c * n + cn, h, mask=mask_cn)
            for l in tl.range(CHUNK, num_stages=STAGES):        # the next steps' loads in flight
                t = k * CHUNK + l
                mc, mn = mask_c & (offs_c * 0 + t < T), mask_n & (offs_n * 0 + t < T)
                xt = tl.load(x_row + t * sxt, mask=mc, other=0.0).to(tl.float32)
                dtt = tl.load(dt_row + t * sdt, mask=mc, other=0.0).to(tl.float32)
                Bt = tl.load(B_row + t * sBt, mask=mn, other=0.0).to(tl.float32)
                Ct = tl.load(C_row + t * sCt, mask=mn, other=0.0).to(tl.float32)
                h = tl.exp2(dtt[:, None] * A2) * h + (dtt * xt)[:, None] * Bt[None, :]
                yt = tl.sum(h * Ct[None, :], axis=1)
                tl.store(y_row + t * c, yt.to(y_ptr.dtype.element_ty), mask=mc)
        tl.store(last_ptr + b * c * n + cn, h.to(last_ptr.dtype.element_ty), mask=mask_cn)

    @triton.jit
    def _scan_bwd(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, gy_ptr, ckpt_ptr, scratch_ptr,
                  dx_ptr, ddt_ptr, dA_ptr, dB_ptr, dC_ptr, dh0_ptr,
                  sxb, sxt, sxc, sdb, sdt, sdc, sBb, sBt, sBn, sCb, sCt, sCn, sgb, sgt, sgc,
                  T, c, n, n_chunks,
                  HAS_H0: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
                  STAGES: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        n_blocks = tl.num_programs(1)
        offs_c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
        offs_n = tl.arange(0, BLOCK_N)
        mask_c, mask_n = offs_c < c, offs_n < n
        mask_cn = mask_c[:, None] & mask_n[None, :]
        cn = offs_c[:, None] * n + offs_n[None, :]
        A = tl.load(A_ptr + cn, mask=mask_cn, other=0.0).to(tl.float32)
        A2 = A * 1.4426950408889634
        x_row, dt_row = x_ptr + b * sxb + offs_c * sxc, dt_ptr + b * sdb + offs_c * sdc
        g_row = gy_ptr + b * sgb + offs_c * sgc
        B_row, C_row = B_ptr + b * sBb + offs_n * sBn, C_ptr + b * sCb + offs_n * sCn
        dx_row, ddt_row = dx_ptr + b * T * c + offs_c, ddt_ptr + b * T * c + offs_c
        partial = (b * n_blocks + blk) * T * n + offs_n                # dB, dC: [B, blocks, T, n]
        # this program's scratch: the states of one chunk, entry l + 1 after position l
        scratch = (scratch_ptr + (b * n_blocks + blk) * (CHUNK + 1) * BLOCK_C * BLOCK_N
                   + tl.arange(0, BLOCK_C)[:, None] * BLOCK_N + offs_n[None, :])
        mu = tl.zeros([BLOCK_C, BLOCK_N], dtype=tl.float32)            # a_{t+1} lambda_{t+1}
        dA = tl.zeros([BLOCK_C, BLOCK_N], dtype=tl.float32)
        for kk in range(n_chunks):
            k = n_chunks - 1 - kk
            h = tl.load(ckpt_ptr + (b * n_chunks + k) * c * n + cn, mask=mask_cn, other=0.0)
            tl.store(scratch, h)
            for l in tl.range(CHUNK, num_stages=STAGES):
                t = k * CHUNK + l
                mc, mn = mask_c & (offs_c * 0 + t < T), mask_n & (offs_n * 0 + t < T)
                xt = tl.load(x_row + t * sxt, mask=mc, other=0.0).to(tl.float32)
                dtt = tl.load(dt_row + t * sdt, mask=mc, other=0.0).to(tl.float32)
                Bt = tl.load(B_row + t * sBt, mask=mn, other=0.0).to(tl.float32)
                h = tl.exp2(dtt[:, None] * A2) * h + (dtt * xt)[:, None] * Bt[None, :]
                tl.store(scratch + (l + 1) * BLOCK_C * BLOCK_N, h)
            tl.debug_barrier()
            for ll in tl.range(CHUNK, num_stages=STAGES):
                l = CHUNK - 1 - ll
                t = k * CHUNK + l
                mc, mn = mask_c & (offs_c * 0 + t < T), mask_n & (offs_n * 0 + t < T)
                xt = tl.load(x_row + t * sxt, mask=mc, other=0.0).to(tl.float32)
                dtt = tl.load(dt_row + t * sdt, mask=mc, other=0.0).to(tl.float32)
                gt = tl.load(g_row + t * sgt, mask=mc, other=0.0).to(tl.float32)
                Bt = tl.load(B_row + t * sBt, mask=mn, other=0.0).to(tl.float32)
                Ct = tl.load(C_row + t * sCt, mask=mn, other=0.0).to(tl.float32)
                h = tl.load(scratch + (l + 1) * BLOCK_C * BLOCK_N)
                h_prev = tl.load(scratch + l * BLOCK_C * BLOCK_N)
                lam = mu + gt[:, None] * Ct[None, :]
                a = tl.exp2(dtt[:, None] * A2)
                g_log = lam * a * h_prev                                  # dL/d(dt A)_t
                dw = tl.sum(lam * Bt[None, :], axis=1)
                tl.store(dx_row + t * c, (dw * dtt).to(dx_ptr.dtype.element_ty), mask=mc)
                ddt = tl.sum(g_log * A, axis=1) + dw * xt
                tl.store(ddt_row + t * c, ddt.to(ddt_ptr.dtype.element_ty), mask=mc)
                tl.store(dB_ptr + partial + t * n, tl.sum(lam * (dtt * xt)[:, None], axis=0), mask=mn)
                tl.store(dC_ptr + partial + t * n, tl.sum(h * gt[:, None], axis=0), mask=mn)
                dA += g_log * dtt[:, None]
                mu = a * lam
            tl.debug_barrier()                       # the next chunk overwrites the scratch
        tl.store(dA_ptr + b * c * n + cn, dA, mask=mask_cn)
        if HAS_H0:
            tl.store(dh0_ptr + b * c * n + cn, mu.to(dh0_ptr.dtype.element_ty), mask=mask_cn)


    # triton.jit made each kernel an InterpretedFunction if TRITON_INTERPRET=1 was set then
    INTERPRET = type(_scan_fwd).__name__ == "InterpretedFunction"
    # FMA contraction on, as Triton's default was until 3.9 (which warns when it is unset)
    _LAUNCH = {} if INTERPRET else {"enable_fp_fusion": True}

    def _fitting(configs, named_args, **kwargs):
        """The forward's configs whose [BLOCK_C, BLOCK_N] state stays in registers (at most 4096 fp32
        elements a program: 32 a thread at 4 warps); the smallest when none does."""
        fits = [cf for cf in configs if cf.kwargs["BLOCK_C"] * kwargs["BLOCK_N"] <= 4096]
        return fits or configs[:1]

    def _run_once(kernel_call, quantiles):
        """The interpreter's stand-in for do_bench (which times CUDA events): run each config once (so every
        config is executed, and checked by the tests), timed on the host."""
        t0 = time.perf_counter()
        kernel_call()
        return [time.perf_counter() - t0] * len(quantiles)

    # the forward with its block sizes tuned per shape (d_inner, d_state) on first use: block_c=None
    _scan_fwd_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_C": bc}, num_warps=w) for bc, w in FWD_CONFIGS],
        key=["c", "n"], prune_configs_by={"early_config_prune": _fitting},
        do_bench=_run_once if INTERPRET else None)(_scan_fwd)


def _geometry(n: int, block_c: int) -> tuple[int, int]:
    """BLOCK_N (n padded to a power of two) and the warps of a program (untuned: about 8 state
    elements per thread)."""
    block_n = max(2, 1 << (n - 1).bit_length())
    return block_n, max(1, min(8, block_c * block_n // 256))


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def check_inputs(x, dt, A, B, C, h0) -> None:
    """A clear error for what the kernels cannot take (shapes, dtypes, devices)."""
    if x.dim() != 3 or dt.shape != x.shape:
        raise ValueError(f"x and dt must be [B, T, c] alike, got {tuple(x.shape)} and {tuple(dt.shape)}")
    Bsz, T, c = x.shape
    if A.dim() != 2 or A.shape[0] != c:
        raise ValueError(f"A must be [c, n] with c = {c}, got {tuple(A.shape)}")
    n = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if t.shape != (Bsz, T, n):
            raise ValueError(f"{name} must be [B, T, n] = {(Bsz, T, n)}, got {tuple(t.shape)}")
    if h0 is not None and h0.shape != (Bsz, c, n):
        raise ValueError(f"h0 must be [B, c, n] = {(Bsz, c, n)}, got {tuple(h0.shape)}")
    tensors = [t for t in (x, dt, A, B, C, h0) if t is not None]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise ValueError("the Triton scan takes float32, bfloat16 or float16 inputs, all of one dtype, got "
                         + ", ".join(str(t.dtype).removeprefix("torch.") for t in tensors))
    if any(t.device != x.device for t in tensors):
        raise ValueError("the scan's inputs must be on one device, got " + ", ".join(str(t.device) for t in tensors))
    if T == 0 or c == 0 or n == 0 or Bsz == 0:
        raise ValueError(f"the Triton scan needs a non-empty input, got B {Bsz}, T {T}, c {c}, n {n}")
    if n > MAX_D_STATE:
        raise ValueError(f"the Triton scan keeps the state in registers: d_state <= {MAX_D_STATE}, got {n}")


def runnable(x: torch.Tensor) -> str | None:
    """None if the kernels can run on ``x``'s device, else why not."""
    if not AVAILABLE:
        return (f"triton fails to import: {TRITON_SCAN_ERROR!r}" if TRITON_SCAN_ERROR is not None
                else "triton is not installed")
    if not x.is_cuda and not INTERPRET:
        return ("the Triton scan runs on CUDA tensors; on CPU only under Triton's interpreter "
                "(TRITON_INTERPRET=1 set before fpscale.ops.scan_triton is first imported)")
    return None


class _TritonScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, chunk, block_c, grad_enabled):
        Bsz, T, c = x.shape
        n = A.shape[1]
        n_chunks = -(-T // chunk)
        block_n, warps = _geometry(n, block_c or DEFAULT_BLOCK_C)
        save = grad_enabled and any(ctx.needs_input_grad[:6])     # (needs_input_grad ignores no_grad)
        A = A.contiguous()
        h0c = None if h0 is None else h0.contiguous()
        y = x.new_empty(Bsz, T, c)
        last = x.new_empty(Bsz, c, n)
        ckpt = x.new_empty((Bsz, n_chunks, c, n) if save else (1,), dtype=torch.float32)
        args = (x, dt, A, B, C, last if h0c is None else h0c, y, last, ckpt,
                *_strides(x), *_strides(dt), *_strides(B), *_strides(C), T, c, n, n_chunks)
        if block_c is None:           # autotuned per (c, n): the checkpoints' layout does not depend on it
            _scan_fwd_tuned[lambda meta: (Bsz, triton.cdiv(c, meta["BLOCK_C"]))](
                *args, HAS_H0=h0 is not None, SAVE=save, CHUNK=chunk, BLOCK_N=block_n, STAGES=STAGES, **_LAUNCH)
        else:
            _scan_fwd[(Bsz, triton.cdiv(c, block_c))](
                *args, HAS_H0=h0 is not None, SAVE=save, CHUNK=chunk, BLOCK_C=block_c, BLOCK_N=block_n,
                STAGES=STAGES, num_warps=warps, **_LAUNCH)
        ctx.mark_non_differentiable(last)
        if save:
            ctx.chunk, ctx.block_c, ctx.has_h0 = chunk, block_c, h0 is not None
            ctx.save_for_backward(x, dt, A, B, C, ckpt)
        return y, last

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, _glast):
        x, dt, A, B, C, ckpt = ctx.saved_tensors
        Bsz, T, c = x.shape
        n, chunk, block_c = A.shape[1], ctx.chunk, ctx.block_c or DEFAULT_BLOCK_C
        block_n, warps = _geometry(n, block_c)
        n_blocks = triton.cdiv(c, block_c)
        f32 = dict(dtype=torch.float32)
        scratch = x.new_empty(Bsz * n_blocks * (chunk + 1) * block_c * block_n, **f32)
        dx, ddt = torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(Bsz, T, c)
        dA = x.new_empty(Bsz, c, n, **f32)
        dB, dC = (x.new_empty(Bsz, n_blocks, T, n, **f32) for _ in range(2))
        dh0 = x.new_empty(Bsz, c, n) if ctx.has_h0 else dA
        _scan_bwd[(Bsz, n_blocks)](x, dt, A, B, C, gy, ckpt, scratch, dx, ddt, dA, dB, dC, dh0,
                                   *_strides(x), *_strides(dt), *_strides(B), *_strides(C), *_strides(gy),
                                   T, c, n, ckpt.shape[1], HAS_H0=ctx.has_h0, CHUNK=chunk, BLOCK_C=block_c,
                                   BLOCK_N=block_n, STAGES=STAGES, num_warps=warps, **_LAUNCH)
        dt_ = x.dtype
        return (dx, ddt, dA.sum(0).to(dt_), dB.sum(1).to(dt_), dC.sum(1).to(dt_),
                dh0 if ctx.has_h0 else None, None, None, None)


def triton_selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          h0: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK,
                          block_c: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, dt: [B, T, c]; A: [c, n] (<= 0); B, C: [B, T, n]; h0: [B, c, n] or None (one dtype: float32,
    bfloat16 or float16). Returns y [B, T, c] and the last state [B, c, n] in that dtype; the state
    runs in float32. ``chunk``: steps between the checkpoints kept for backward; ``block_c``:
    channels per program (a power of two), or None: the forward's tuned per (c, n) by ``triton.autotune``
    over ``FWD_CONFIGS`` on first use, the backward's ``DEFAULT_BLOCK_C``."""
    why = runnable(x)
    if why is not None:
        raise RuntimeError(f"fpscale's Triton scan cannot run here: {why}")
    check_inputs(x, dt, A, B, C, h0)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if block_c is not None and (block_c < 1 or block_c & (block_c - 1)):
        raise ValueError(f"block_c must be a power of two, got {block_c}")
    chunk = min(chunk, triton.next_power_of_2(x.shape[1]))       # decoding (T = 1) runs one step, not 64
    device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()   # launch on x's GPU
    with torch.autocast(x.device.type, enabled=False), device:
        return _TritonScan.apply(x, dt, A, B, C, h0, chunk, block_c, torch.is_grad_enabled())
