"""Data pipeline throughput on the bundled corpus.

    python bench/data.py            # needs cache/corpus (README set-up command)

1. tokenization: tokens/s of the SentencePiece encode step per worker count
2. loader: samples/s drawing random global batches at seq 2048 from the memmapped shards
3. loader time / training-step time for each tiny config (same micro-batch, one process)
"""
from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

from common import print_table, write_json

from fpscale.data.loader import DistributedBatches
from fpscale.data.shards import TokenShards
from fpscale.data.tokenizer import _encode_unit, _init_worker

ROOT = Path(__file__).resolve().parent.parent


def tokenization(corpus: str, model: str, workers: int, docs_per_unit: int = 64) -> dict:
    import pyarrow.parquet as pq
    texts = [t for t in pq.read_table(corpus, columns=["text"]).column("text").to_pylist()]
    units = [(k, [(str(i), t) for i, t in enumerate(texts[s:s + docs_per_unit])], 0.0)
             for k, s in enumerate(range(0, len(texts), docs_per_unit))]
    with mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(model,)) as pool:
        pool.map(_encode_unit, units[:workers])                     # warm the workers
        t0 = time.perf_counter()
        n = sum(len(ids) for _, enc in pool.imap(_encode_unit, units) for _, ids in enc)
        dt = time.perf_counter() - t0
    return {"workers": workers, "documents": len(texts), "tokens": n, "tokens_per_s": n / dt}


def loader(tokens_dir: str, seq_len: int, batch: int, steps: int) -> dict:
    ds = TokenShards(tokens_dir, "train", seq_len)
    batches = DistributedBatches(ds, batch, batch, seed=0)
    batches.next_global_batch()
    t0 = time.perf_counter()
    for _ in range(steps):
        batches.next_global_batch()
    dt = time.perf_counter() - t0
    return {"seq_len": seq_len, "batch": batch, "samples_per_s": steps * batch / dt,
            "ms_per_batch": 1e3 * dt / steps}


def step_ratio(config: str, steps: int = 5) -> dict:
    import fpscale
    from fpscale.train.trainer import Trainer
    cfg = fpscale.load_config(config, ["train.eval_interval=100000", "train.log_interval=100000",
                                       f"train.steps={steps + 1}", "train.resume=none"])
    trainer = Trainer(cfg, log=False)
    trainer.train_step()                                            # warm-up
    t_load = t_step = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.batches.next_global_batch()
        t_load += time.perf_counter() - t0
        trainer.batches.consumed_samples -= trainer.batches.global_batch
        t0 = time.perf_counter()
        trainer.train_step()
        t_step += time.perf_counter() - t0
    return {"config": os.path.basename(config), "step_ms": 1e3 * t_step / steps,
            "loader_ms": 1e3 * t_load / steps, "loader_over_step": t_load / t_step}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(ROOT / "cache/corpus"))
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    raw = glob.glob(os.path.join(args.corpus, "raw", "*.parquet"))
    if not raw or not os.path.exists(os.path.join(args.corpus, "tokens", "metadata.json")):
        sys.exit(f"no prepared corpus under {args.corpus}: run the README's set-up command first")
    tok = [tokenization(raw[0], os.path.join(args.corpus, "tokenizer.model"), w) for w in args.workers]
    print("tokenization (SentencePiece BPE 8000, bundled corpus)")
    print_table(tok, ["workers", "documents", "tokens", "tokens_per_s"])
    load = [loader(os.path.join(args.corpus, "tokens"), s, b, 200) for s, b in ((2048, 8), (128, 16))]
    print("\nloader (random global order over memmapped shards)")
    print_table(load, ["seq_len", "batch", "samples_per_s", "ms_per_batch"])
    os.chdir(ROOT)
    ratios = [step_ratio(c) for c in sorted(glob.glob(str(ROOT / "configs/tiny_*.yaml")))]
    print("\nloader time vs one training step (tiny configs, one process)")
    print_table(ratios, ["config", "step_ms", "loader_ms", "loader_over_step"])
    write_json("data", {"tokenization": tok, "loader": load, "step_ratio": ratios}, args.out)


if __name__ == "__main__":
    main()
