"""FP-Mamba's selective scan, in plain PyTorch, without materialising the state of every step.

    h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t^T        per channel c and state n (A <= 0, dt >= 0)
    y_t = h_t C_t                                       y_t[c] = sum_n h_t[c, n] C_t[n]

``selective_scan(x, dt, A, B, C, h0)`` is what the layer calls (mamba-ssm's interface, plus an
initial state and without D and the gate). A is per (channel, state), as in Mamba-1, so the decay
between two steps differs for every state n: there is no SSD matrix form (that needs one decay
per head), and the intra-chunk work stays a recurrence. It is chunked so that it never builds
``[B, T, d_inner, d_state]`` in the forward:
  1. all chunks at once, a loop over the L positions of a chunk from a zero state: each chunk's
     end state (the decay and input of a step are made on the fly, [B, T/L, d_inner, d_state]);
  2. a loop over the T/L chunks carries the states across chunk boundaries (the decay of a whole
     chunk is exp(A sum dt), an exponent <= 0);
  3. the loop over positions again, from the right start states, contracting with C at each
     step: only y [B, T, d_inner] and the last state leave.
Every exponent is dt A <= 0 (or a sum of them), so nothing overflows for any decay. The forward
saves its inputs and the T/L chunk start states; the backward recomputes the states chunk-wise
and runs the adjoint recurrence (lambda_t = g_t C_t + a_{t+1} lambda_{t+1}) the same way.

``sequential_scan`` (h_t = a_t h_{t-1} + b_t, step by step) is the float64 reference the tests
hold it to. On a GPU, ``fpscale.ops.scan_kernels`` dispatches to mamba-ssm's ``selective_scan_fn``
(full sequences, when installed), else fpscale's Triton scan (``fpscale.ops.scan_triton``), and runs
this one there only as a last resort, with a warning.

    python -m pytest tests/ops/test_scan.py -q
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 16
LOG2E = 1.4426950408889634


def sequential_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
    """a, b: [B, T, ...] -> h: [B, T, ...] with h_t = a_t h_{t-1} + b_t."""
    h = torch.zeros_like(b[:, 0]) if h0 is None else h0
    out = []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


def reference_selective_scan(x, dt, A, B, C, h0=None):
    """The selective scan by ``sequential_scan`` on the materialised decay and input (the reference)."""
    a = torch.exp(dt.unsqueeze(-1) * A)
    h = sequential_scan(a, (dt * x).unsqueeze(-1) * B.unsqueeze(-2), h0)
    return (h * C.unsqueeze(-2)).sum(-1), h[:, -1]


def _chunked(t: torch.Tensor, L: int) -> torch.Tensor:
    """[B, T, X] -> [B, T/L, L, X], zero-padded at the end (dt = 0 there: the state is held)."""
    pad = (-t.shape[1]) % L
    if pad:
        t = F.pad(t, (0, 0, 0, pad))
    return t.view(t.shape[0], -1, L, t.shape[-1])


# Inside, a state is laid out [B, K, n, c] (channels innermost: every broadcast runs along an outer
# dim and vectorises), and exp(dt A) is computed as exp2(dt A log2(e)) (torch's exp2 vectorises
# better than its exp on CPU). A2 = (A log2 e)^T is [n, c].

def _decay(dtc: torch.Tensor, l: int, A2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(dt A) of position l of every chunk, [B, K, n, c] (exponent <= 0)."""
    return torch.mul(dtc[:, :, l, None, :], A2, out=out).exp2_()


def _step(h: torch.Tensor, a: torch.Tensor, wc: torch.Tensor, Bc: torch.Tensor, l: int) -> torch.Tensor:
    """a * h + B_l w_l^T, written into a (in place: no broadcast allocation per step)."""
    return a.mul_(h).addcmul_(Bc[:, :, l, :, None], wc[:, :, l, None, :])


def _chunk_starts(dtc, wc, Bc, A2, h0):
    """Passes 1 and 2: the state at the start of every chunk [B, K, n, c] and the last state."""
    Bsz, K, L, di = dtc.shape
    h = dtc.new_zeros(Bsz, K, A2.shape[0], di)
    for l in range(L):
        h = _step(h, _decay(dtc, l, A2), wc, Bc, l)
    decay = torch.mul(dtc.sum(2).unsqueeze(2), A2).exp2_()            # a whole chunk's decay
    starts = torch.empty_like(h)
    s = torch.zeros_like(h[:, 0]) if h0 is None else h0
    for k in range(K):
        starts[:, k] = s
        s = torch.addcmul(h[:, k], decay[:, k], s)
    return starts, s


def _full_precision(method):
    """Run a pass of the scan outside autocast: its contractions are matmuls, which bf16 autocast
    would run in bf16, and the scan and its state stay in the inputs' precision (float32 in the
    layer: fpscale.solvers.precision)."""
    def wrapped(ctx, *args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        with torch.autocast(device.type, enabled=False):
            return method(ctx, *args)
    return wrapped


def _scan_forward(x, dt, A, B, C, h0, chunk):
    """The scan's forward: y, the last state and the chunk starts the backward reads."""
    T = x.shape[1]
    L = max(1, min(chunk, T))
    A2 = (A * LOG2E).t().contiguous()
    dtc, wc, Bc, Cc = (_chunked(t, L) for t in (dt, dt * x, B, C))
    starts, last = _chunk_starts(dtc, wc, Bc, A2, None if h0 is None else h0.transpose(-1, -2))
    h = starts
    ys = []
    for l in range(L):
        h = _step(h, _decay(dtc, l, A2), wc, Bc, l)
        ys.append(torch.matmul(Cc[:, :, l, None, :], h).squeeze(-2))       # sum over n
    y = torch.stack(ys, 2).flatten(1, 2)[:, :T]
    return y, last.transpose(-1, -2).contiguous(), starts


class _SelectiveScan(torch.autograd.Function):
    """In torch.func's form (forward without ctx, ``setup_context``; the chunk starts the backward reads
    are a third output, dropped by ``selective_scan``): torch.func.vjp can differentiate an f that scans
    (``solver.adjoint.adjoint_step: vjp``, fpscale.solvers.backward.VjpStep)."""
    @staticmethod
    def forward(x, dt, A, B, C, h0, chunk):
        with torch.autocast(x.device.type, enabled=False):      # _full_precision (dynamo binds forward's own
            return _scan_forward(x, dt, A, B, C, h0, chunk)      # signature: no wrapper around it)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, dt, A, B, C, h0, chunk = inputs
        _, last, starts = output
        ctx.chunk, ctx.has_h0 = max(1, min(chunk, x.shape[1])), h0 is not None
        ctx.save_for_backward(x, dt, A, B, C, starts)
        ctx.mark_non_differentiable(last, starts)

    @staticmethod
    @_full_precision
    def backward(ctx, gy, _glast, _gstarts):
        x, dt, A, B, C, starts = ctx.saved_tensors
        L, T = ctx.chunk, x.shape[1]
        A2 = (A * LOG2E).t().contiguous()
        dtc, xc, Bc, Cc, gyc = (_chunked(t, L) for t in (dt, x, B, C, gy))
        wc = dtc * xc
        Bsz, K, _, di = dtc.shape
        N = A.shape[-1]
        # the decays and states at every position, recomputed from the saved chunk starts
        H, decays = dtc.new_empty(Bsz, K, L, N, di), dtc.new_empty(Bsz, K, L, N, di)
        h = starts
        for l in range(L):
            a = _decay(dtc, l, A2, out=decays[:, :, l])
            h = torch.mul(a, h, out=H[:, :, l]).addcmul_(Bc[:, :, l, :, None], wc[:, :, l, None, :])
        # adjoint lambda_t = C_t g_t + a_{t+1} lambda_{t+1}: per chunk from a zero right end, what
        # it hands to the chunk before (a_first lambda_first), then carried right to left
        mu = torch.zeros_like(starts)                    # a_{next first} lambda_{next first}, per chunk
        m = torch.zeros_like(starts[:, 0])
        if K > 1 or ctx.has_h0:
            lam = torch.zeros_like(starts)
            for l in reversed(range(L)):
                lam = lam.addcmul_(Cc[:, :, l, :, None], gyc[:, :, l, None, :]).mul_(decays[:, :, l])
            decay = torch.mul(dtc.sum(2).unsqueeze(2), A2).exp2_()
            for k in reversed(range(K)):
                mu[:, k] = m
                m = torch.addcmul(lam[:, k], decay[:, k], m)
        grad_h0 = m.transpose(-1, -2) if ctx.has_h0 else None
        # lambda at every position from the right carries, and the gradients step by step:
        # dL/d(dt A)_t = lambda_t a_t h_{t-1}, dL/dw_t = B_t lambda_t, dL/dB_t = lambda_t w_t, dL/dC_t = h_t g_t
        g_dt, g_w, g_B, g_C = (torch.empty_like(t) for t in (dtc, dtc, Bc, Cc))
        g_log_dt = torch.zeros_like(starts)              # sum over positions of dL/d(dt A) dt, per chunk
        At = A.t()
        lam = mu
        for l in reversed(range(L)):
            lam = lam.addcmul_(Cc[:, :, l, :, None], gyc[:, :, l, None, :])
            g_w[:, :, l] = torch.matmul(Bc[:, :, l, None, :], lam).squeeze(-2)
            g_B[:, :, l] = (lam * wc[:, :, l, None, :]).sum(-1)
            g_C[:, :, l] = (H[:, :, l] * gyc[:, :, l, None, :]).sum(-1)
            lam = lam.mul_(decays[:, :, l])
            g_log = lam * (H[:, :, l - 1] if l else starts)
            g_dt[:, :, l] = (g_log * At).sum(-2)
            g_log_dt.addcmul_(g_log, dtc[:, :, l, None, :])
        g_A = g_log_dt.sum((0, 1)).t()
        g_dt = g_dt + g_w * xc
        g_x = g_w * dtc

        def unchunk(t):
            return t.flatten(1, 2)[:, :T]

        return unchunk(g_x), unchunk(g_dt), g_A, unchunk(g_B), unchunk(g_C), grad_h0, None


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   h0: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """x, dt: [B, T, c]; A: [c, n] (<= 0); B, C: [B, T, n]; h0: [B, c, n] or None.
    Returns y [B, T, c] and the last state [B, c, n] (not differentiable: the decode cache)."""
    y, last, _ = _SelectiveScan.apply(x, dt, A, B, C, h0, chunk)
    return y, last
