"""What fp32 gradient accumulation and reduction cost in memory under DeepSpeed bf16, per rank and
ZeRO stage: the bytes of every live tensor in the process (each storage counted once), for the old
config (DeepSpeed's bf16 defaults) and the new one (fp32), after initialisation, at every micro-batch
boundary of the second training step (engine.step, before and after: the first step also creates
the Adam moments) and after it, less what was alive before the Trainer was built. Used by
tests/parallel/test_bf16_accumulation.py; on CPU, so it counts what DeepSpeed allocates, not a GPU
allocator's caching.

    torchrun --nproc_per_node 2 tests/parallel/run_bf16_memory.py OUT_DIR [key=value ...]

Writes rank{RANK}.json: {"zero0": {"old": {...}, "new": {...}}, ...} with the parameter count P,
the data-parallel size N and the byte counts.
"""
import gc
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import fpscale  # noqa: E402
from fpscale.train import trainer as trainer_module  # noqa: E402
from tests.parallel.run_bf16_accumulation import CURRENT, deepspeed_defaults  # noqa: E402

BASE = ["data.source=synthetic", "data.seq_len=32", "model.vocab_size=64", "model.d_model=128",
        "model.max_seq_len=32", "train.micro_batch=2", "train.global_batch=8", "train.steps=2", "train.warmup=1",
        "train.log_interval=1000", "train.eval_interval=1000", "train.resume=none", "train.precision=bf16"]


def live_bytes() -> int:
    """Bytes of every tensor storage alive in this process (views and aliases counted once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):
            continue
    return sum(storages.values())


def measure(out: str, zero: int, old: bool, extra: list[str]) -> tuple[dict, object]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_attn.yaml"),
                                  BASE + [f"parallel.zero_stage={zero}", f"train.out_dir={out}",
                                          f"name=z{zero}{old}", *extra])
    base = live_bytes()
    trainer_module.deepspeed_config = deepspeed_defaults if old else CURRENT
    try:
        trainer = trainer_module.Trainer(cfg, log=False)
    finally:
        trainer_module.deepspeed_config = CURRENT
    params = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters())   # ZeRO-3: whole
    record = {"params": params, "dp": trainer.state.dp_size, "optimizer": type(trainer.optimizer).__name__,
              "init": live_bytes() - base, "boundaries": []}
    trainer.train_step()
    engine, step = trainer.engine, trainer.engine.step

    def measured_step(*args, **kwargs):
        record["boundaries"].append(live_bytes() - base)
        result = step(*args, **kwargs)
        record["boundaries"].append(live_bytes() - base)
        return result
    engine.step = measured_step
    trainer.train_step()
    record["after"] = live_bytes() - base
    record["peak"] = max(record["boundaries"] + [record["init"], record["after"]])
    return record, trainer


def main():
    out, extra = sys.argv[1], sys.argv[2:]
    report, last = {}, None
    for zero in (0, 1, 2, 3):
        for variant in ("old", "new"):
            if last is not None:        # one process group for every run: the last one closes it
                last.owns_state = False
                last.close()
                last = None
                gc.collect()
            record, last = measure(out, zero, variant == "old", extra)
            report.setdefault(f"zero{zero}", {})[variant] = record
    with open(os.path.join(out, f"rank{last.state.rank}.json"), "w") as fh:
        json.dump(report, fh)
    last.close()


if __name__ == "__main__":
    main()
