"""Convert between sharded checkpoints, one safetensors file and a Hugging Face model folder.

    # sharded checkpoint (any TP x DP x ZeRO layout, or one process) -> model.safetensors + config.yaml
    python launch/convert.py --checkpoint runs/tiny_mixed/checkpoints/step_00000300 --out exported/

    # -> a Hugging Face folder: AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    #    (the tokenizer: beside the config's token shards, or --tokenizer; fpscale.hf)
    python launch/convert.py --checkpoint runs/tiny_mixed/checkpoints/step_00000300 --to hf --out exported/hf

    # jacobfa/Attractor's save_pretrained folder (config.json + model.pt or model.safetensors) <-> fpscale
    python launch/convert.py --from attractor their_folder/ --out exported/      # -> whole weights
    python launch/convert.py --checkpoint exported/ --to attractor --out theirs/  # -> their folder

    # and back: whole weights -> a step-0 sharded checkpoint of run NAME on this launch's layout,
    # which `launch/pretrain.py ... name=NAME` then resumes (fresh optimizer, the weights kept)
    torchrun --nproc_per_node 2 launch/convert.py --weights exported/ --name NAME [key=value ...]

The config of the exported weights travels with them (config.yaml); overrides apply on top
(e.g. parallel.tp=2, train.out_dir=...). Exit code 2 for input that cannot be converted (the
codes: fpscale/errors.py).
"""
from __future__ import annotations

import argparse
import os
import sys

from fpscale.cli import reported
from fpscale.errors import CheckpointError, UserError


@reported
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="sharded checkpoint folder to consolidate (--to hf: or exported weights)")
    ap.add_argument("--out", help="output folder for model.safetensors + config.yaml (or the HF folder)")
    ap.add_argument("--from", dest="source", nargs=2, metavar=("FORMAT", "DIR"),
                    help="attractor DIR: jacobfa/Attractor's save_pretrained folder -> whole weights in --out")
    ap.add_argument("--to", choices=["safetensors", "hf", "attractor"], default="safetensors",
                    help="what --checkpoint becomes: fpscale's safetensors + config.yaml, or a Hugging Face folder")
    ap.add_argument("--tokenizer", help="--to hf: the SentencePiece model or tokenizer.json (default: the one the "
                         "config's data was prepared with)")
    ap.add_argument("--no-tokenizer", action="store_true", help="--to hf: no tokenizer (synthetic-token models)")
    ap.add_argument("--eval-depth", type=int, default=None,
                    help="--to hf: the evaluation depth recorded in config.json (default: each layer's eval_max_iter)")
    ap.add_argument("--weights", help="folder with model.safetensors + config.yaml to shard")
    ap.add_argument("--name", help="run name of the sharded checkpoint written from --weights")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of the weights' config")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.source:
        fmt, folder = args.source
        if fmt != "attractor" or not args.out:
            ap.error("--from takes attractor DIR, with --out")
        from fpscale.hf.attractor import import_folder
        import_folder(folder, args.out)
        print(f"wrote {os.path.join(args.out, 'model.safetensors')} and config.yaml from Attractor's {folder}")
        return 0
    if args.checkpoint and args.out and args.to == "attractor":
        from fpscale.hf.attractor import export_folder
        export_folder(args.checkpoint, args.out)
        print(f"wrote Attractor's config.json, model.pt and model.safetensors in {args.out}")
        return 0
    if args.checkpoint and args.out:
        from fpscale.train.checkpoint import export_safetensors, verify
        if os.path.exists(os.path.join(args.checkpoint, "meta.json")):
            problem = verify(args.checkpoint)
            if problem:
                raise CheckpointError(f"cannot convert {args.checkpoint}: {problem}")
        if args.to == "hf":
            from fpscale.hf.export import export_hf
            if args.eval_depth is not None and args.eval_depth < 1:
                raise UserError(f"--eval-depth must be >= 1, got {args.eval_depth}")
            export_hf(args.checkpoint, args.out, False if args.no_tokenizer else args.tokenizer, args.eval_depth)
            print(f"wrote the Hugging Face folder {args.out} (AutoModelForCausalLM.from_pretrained(..., "
                  f"trust_remote_code=True))")
            return 0
        export_safetensors(args.checkpoint, args.out)
        print(f"wrote {os.path.join(args.out, 'model.safetensors')} and config.yaml")
        return 0
    if args.weights and args.name:
        import fpscale
        from fpscale.train.trainer import Trainer
        cfg = fpscale.load_config(os.path.join(args.weights, "config.yaml"), [
            f"name={args.name}", f"train.init_weights={args.weights}", "train.resume=none", *args.overrides])
        with Trainer(cfg, log=False) as trainer:
            trainer.save_checkpoint()
        return 0
    ap.error("give --checkpoint and --out, or --weights and --name")


if __name__ == "__main__":
    sys.exit(main())
