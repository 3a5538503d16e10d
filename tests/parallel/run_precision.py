"""DeepSpeed's bf16 engine on 2 ranks: solver iterations per looped layer of each tiny config
on fixed token batches, eval and train mode (used by tests/models/test_precision.py). The batches are
shared out as data parallelism shares them: rank r runs batches r, r + world, ... (ZeRO-1's forward
has no collective), and the test joins the ranks' lists in batch order.

    torchrun --nproc_per_node 2 tests/parallel/run_precision.py OUT_DIR tiny_fpsa tiny_looped ...
"""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fpscale  # noqa: E402
from fpscale.train.trainer import Trainer  # noqa: E402
from tests.models.helpers import solver_iterations, token_batches  # noqa: E402


def main():
    out, names = sys.argv[1], sys.argv[2:]
    report = {}
    for name in names:
        overrides = ["train.precision=bf16", "parallel.zero_stage=1", "data.source=synthetic", "train.resume=none",
                     f"train.out_dir={out}"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = fpscale.load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", f"{name}.yaml"),
                                      overrides)
        trainer = Trainer(cfg, log=False)
        batches = token_batches(cfg.model.vocab_size)[trainer.state.rank::trainer.state.world_size]
        report[name] = {"param_dtype": str(next(trainer.model.parameters()).dtype),
                        **{mode: solver_iterations(trainer.engine, trainer.model, batches, mode == "train")
                           for mode in ("eval", "train")}}
    with open(os.path.join(out, f"rank{trainer.state.rank}.json"), "w") as fh:
        json.dump(report, fh)
    trainer.close()


if __name__ == "__main__":
    main()
