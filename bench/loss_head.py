"""Memory of the LM loss head: the plain head (logits, then F.cross_entropy) against the chunked
cross-entropy (fpscale.ops.chunked_loss, the default ``model.loss_chunk``), fp32 and bf16 autocast.

Two figures per head, at the 125m shape (8 x 2048 tokens, V = 50304, d = 768, chunk 4096):
  saved  bytes saved for backward by the head, hidden states and weight excluded (they live
         anyway): MEASURED with fpscale.profiling.count_saved_bytes at --measure-tokens tokens and
         scaled by tokens / measure-tokens (both heads save per-token tensors only: exact).
  peak   the most bytes the head holds at once over forward + backward, beyond its inputs:
         ANALYTIC, the logits-sized buffers only (plain: 8 bytes per logit in the forward, 12 in
         the backward: the saved fp32 log-softmax, its gradient and the logits' gradient;
         chunked: one chunk's logits, 4 bytes per logit in fp32, 6 under bf16 autocast: the bf16
         product and its fp32 upcast). Weight-sized terms (grad_W, autocast's bf16 weight: a few
         x V x d bytes, alike for both heads) are left out.
The analytic peak is checked against a measurement at a small shape (--measure-*: real V, a small
d so the weight-sized terms stay negligible), where every tensor the head allocates is tracked
(a TorchDispatchMode counting each new storage until it is freed): columns peak_small_*.

On a GPU also the time of one forward + backward under bf16 autocast at the 125m shape, and its peak
memory beyond the inputs (``time_rows``): the plain head, fpscale's chunked head eager and compiled
(``torch.compile`` of the head: what ``train.compile: model`` makes of it), and liger-kernel's fused linear
cross-entropy (``model.loss_kernel: liger``, fpscale.ops.fused_loss; where installed). The faster of the
chunked and liger heads is the one to make the GPU default (``model.loss_kernel``: chunked until measured).

    python bench/loss_head.py                   # a few seconds on CPU (no time rows: they need a GPU)
    python bench/loss_head.py --measure-tokens 512 --measure-chunk 128
    python bench/loss_head.py --repeats 20      # a GPU: + the time rows
"""
from __future__ import annotations

import argparse
import weakref

import torch
import torch.nn.functional as F
from common import print_table, write_json
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fpscale.ops.chunked_loss import chunked_cross_entropy
from fpscale.profiling import count_saved_bytes

GIB = 2 ** 30


class LivePeak(TorchDispatchMode):
    """The peak of the bytes of the storages created inside the block and still alive."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, weakref.ref] = {}

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n and key not in self.refs:
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    self.refs[key] = weakref.ref(st, lambda _, k=key, n=n: self._free(k, n))
        return out


def plain_head(h, w, targets, chunk):
    logits = F.linear(h, w)
    return F.cross_entropy(logits.float() if logits.dtype == torch.bfloat16 else logits, targets)


def chunked_head(h, w, targets, chunk):
    return chunked_cross_entropy(h, w, targets, chunk)


def analytic_peak(head: str, bf16: bool, tokens: int, vocab: int, chunk: int) -> int:
    if head == "plain":
        return 12 * tokens * vocab
    return (6 if bf16 else 4) * min(chunk, tokens) * vocab + 4 * tokens      # + the logsumexp per token


def measure(head, bf16: bool, tokens: int, vocab: int, d: int, chunk: int) -> tuple[int, int]:
    """(saved bytes, peak bytes) of one forward + backward of ``head`` at this shape."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, d, generator=g).requires_grad_()
    w = (torch.randn(vocab, d, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    tracker = LivePeak()
    with tracker, count_saved_bytes(exclude=(h, w, targets)) as saved:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = head(h, w, targets, chunk)
        loss.backward()
    return saved.total, tracker.peak


def liger_head(h, w, targets, chunk):
    from fpscale.ops.fused_loss import fused_cross_entropy
    return fused_cross_entropy(h, w, targets)


def time_heads(args, tokens: int) -> list[dict]:
    """ms per forward + backward (bf16 autocast, CUDA events, median of ``repeats`` after 3 warm-ups) and
    the peak memory beyond the inputs, per head at the full shape."""
    import statistics

    from fpscale.ops.fused_loss import liger_available
    heads = [("plain", plain_head), ("chunked", chunked_head),
             ("chunked compiled", torch.compile(chunked_head, dynamic=False))]
    why = liger_available()
    heads += [("liger", liger_head)] if why is None else []
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(tokens, args.d, device=dev, generator=g).requires_grad_()
    w = (torch.randn(args.vocab, args.d, device=dev, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), device=dev, generator=g)
    rows = []
    for name, head in heads:
        def step():
            h.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = head(h, w, targets, args.chunk)
            loss.backward()
            return loss
        try:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            rows.append({"head": name, "ms_fwd_bwd": statistics.median(times), "loss": float(loss),
                         "peak_extra_GiB": (torch.cuda.max_memory_allocated() - base) / GIB})
        except Exception as exc:          # a head that fails here is a row that says why
            rows.append({"head": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    if why is not None:
        rows.append({"head": "liger", "error": f"not installed ({why})"})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--chunk", type=int, default=4096, help="model.loss_chunk")
    ap.add_argument("--measure-tokens", type=int, default=1024)
    ap.add_argument("--measure-d", type=int, default=16)
    ap.add_argument("--measure-chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per head (a GPU only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    tokens, n_m = args.batch * args.seq, args.measure_tokens
    rows = []
    for name, head in (("plain", plain_head), ("chunked", chunked_head)):
        for bf16 in (False, True):
            saved_m, peak_m = measure(head, bf16, n_m, args.vocab, args.measure_d, args.measure_chunk)
            rows.append({
                "head": name, "precision": "bf16-autocast" if bf16 else "fp32",
                "chunk": args.chunk if name == "chunked" else None,
                "saved_GiB": saved_m * tokens / n_m / GIB,
                "peak_GiB": analytic_peak(name, bf16, tokens, args.vocab, args.chunk) / GIB,
                "saved_small_MiB": saved_m / 2 ** 20,
                "peak_small_MiB": peak_m / 2 ** 20,
                "peak_small_analytic_MiB": analytic_peak(name, bf16, n_m, args.vocab, args.measure_chunk) / 2 ** 20,
            })
    print(f"loss head at {args.batch} x {args.seq} tokens, V {args.vocab}, d {args.d}: saved (measured at "
          f"{n_m} tokens, scaled) and peak (analytic, logits-sized buffers); *_small: measured at {n_m} tokens, "
          f"d {args.measure_d}, chunk {args.measure_chunk}")
    print_table(rows, ["head", "precision", "chunk", "saved_GiB", "peak_GiB", "saved_small_MiB", "peak_small_MiB",
                       "peak_small_analytic_MiB"])
    time_rows = time_heads(args, tokens) if torch.cuda.is_available() else []
    if time_rows:
        print(f"\ntime of forward + backward, bf16 autocast, {tokens} tokens, {torch.cuda.get_device_name()}")
        print_table(time_rows, ["head", "ms_fwd_bwd", "peak_extra_GiB", "loss", "error"])
    else:
        print("\ntime rows (plain, chunked eager and compiled, liger): need a GPU")
    write_json("loss_head", {"args": vars(args), "rows": rows, "time_rows": time_rows,
                             "method": {"saved": "measured with count_saved_bytes at measure_tokens, scaled",
                                        "peak": "analytic (logits-sized buffers); peak_small_* measured"}},
               args.out)


if __name__ == "__main__":
    main()
