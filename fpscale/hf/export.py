"""Write a Hugging Face folder of an fpscale model (``launch/convert.py --to hf``).

    export_hf("runs/tiny_mixed/checkpoints/step_00000300", "exported/tiny_mixed_hf")
    # then, where fpscale need not be installed (transformers, torch, sentencepiece, pyyaml):
    AutoModelForCausalLM.from_pretrained("exported/tiny_mixed_hf", trust_remote_code=True, eval_depth=8)

The folder holds
  config.json                FpscaleConfig: fpscale's model and solver sections, auto_map
  model.safetensors          the whole weights (any checkpoint layout, consolidated), "model." + fpscale's names
  tokenizer.model            the SentencePiece model, with tokenizer_config.json (FpscaleTokenizer), or
  tokenizer.json             the Hugging Face tokenizer the data was prepared with, with tokenizer_config.json
                             (PreTrainedTokenizerFast: AutoTokenizer encodes as the tokenizers library does)
  configuration_fpscale.py   }
  modeling_fpscale.py        } fpscale.hf's three files
  tokenization_fpscale.py    }
  fpscale_*.py               the fpscale modules they import (models, solvers, base), copied with
                             ``from fpscale.a.b import`` made ``from .fpscale_a_b import``
Copying fpscale's own model code, rather than writing a second implementation, is what makes the
logits equal to fpscale's; transformers loads relative imports of a remote-code folder itself.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path

from fpscale.errors import UserError
from fpscale.typed import to_dict

PACKAGE = Path(__file__).resolve().parent.parent            # the fpscale package folder
HF_MODULES = ("configuration_fpscale", "modeling_fpscale", "tokenization_fpscale")
SUPPORTED_TRANSFORMERS = ">=5.0,<6"                           # tested: 5.23.0
SP_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}       # fpscale's SentencePiece models
_FROM = re.compile(r"^(\s*)from fpscale((?:\.\w+)+) import", re.MULTILINE)


def bundled_name(module: str) -> str:
    """The flat file name (without .py) of fpscale module ``module`` inside the folder."""
    if module.startswith("fpscale.hf."):
        return module.rsplit(".", 1)[1]
    return module.replace(".", "_")


def _source(module: str) -> Path:
    path = PACKAGE.parent / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def module_closure(roots: list[str]) -> list[str]:
    """Every fpscale module the roots import, directly or not (lazy imports included)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for node in ast.walk(ast.parse(_source(module).read_text())):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "fpscale" for a in node.names):
                raise RuntimeError(f"{module}: write 'from fpscale.x import y' (the export rewrites only that form)")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fpscale":
                if node.level or node.module == "fpscale":
                    raise RuntimeError(f"{module}: import from a fpscale module by its full name, not "
                                       f"'{'.' * node.level}{node.module}'")
                todo.append(node.module)
    return sorted(seen)


def bundle_source(module: str) -> str:
    """The module's source with its fpscale imports made relative to the folder."""
    return _FROM.sub(lambda m: f"{m[1]}from .{bundled_name('fpscale' + m[2])} import", _source(module).read_text())


def write_code(out: str) -> list[str]:
    """Write the three HF files and the fpscale modules they need into ``out``; their names."""
    modules = module_closure([f"fpscale.hf.{name}" for name in HF_MODULES])
    for module in modules:
        Path(out, bundled_name(module) + ".py").write_text(bundle_source(module))
    return [bundled_name(m) + ".py" for m in modules]


def hf_config(cfg, eval_depth: int | None = None, ids: dict | None = None) -> dict:
    """config.json of the fpscale Config ``cfg``; ``ids``: the tokenizer's bos/eos/pad token ids
    (default: fpscale's SentencePiece ones, 1/2/2)."""
    model = to_dict(cfg.model)
    return {
        "model_type": "fpscale",
        "architectures": ["FpscaleForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_fpscale.FpscaleConfig",
                     "AutoModelForCausalLM": "modeling_fpscale.FpscaleForCausalLM"},
        "fpscale_model": model,
        "fpscale_solver": to_dict(cfg.solver),
        "eval_depth": eval_depth,
        "layer_eval_depth": {},
        "decode_cache": cfg.decode.cache,
        "decode_compact": cfg.decode.compact,
        "vocab_size": model["vocab_size"],
        "hidden_size": model["d_model"],
        "num_attention_heads": model["n_heads"],
        "max_position_embeddings": model["max_seq_len"],
        **(ids or SP_IDS),
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "float32",
    }


def default_tokenizer(cfg) -> str:
    """The tokenizer the config's data was prepared with (beside its token shards, where
    data/prepare_fineweb.py puts it; a blend's first source's)."""
    from fpscale.data.blend import data_tokenizer
    return data_tokenizer(cfg.data)


def export_hf(source: str, out: str, tokenizer: str | bool | None = None, eval_depth: int | None = None) -> str:
    """Write the Hugging Face folder of ``source`` (a checkpoint of any layout or exported weights)
    to ``out``. ``tokenizer``: the SentencePiece model or tokenizer.json (None: the one the config's
    data was prepared with; False: none, for a model of synthetic tokens). Returns ``out``."""
    import torch
    from safetensors.torch import save_file

    from fpscale.train.checkpoint import load_model
    model, cfg = load_model(source)
    tok = None if tokenizer is False else str(tokenizer or default_tokenizer(cfg))
    hf_tok = None
    if tok is not None:
        hf_tok = check_tokenizer(tok, cfg.model.vocab_size)
    ids = SP_IDS if hf_tok is None else {f"{k}_token_id": hf_tok.eos_id for k in ("bos", "eos", "pad")}
    os.makedirs(out, exist_ok=True)
    weights = {f"model.{k}": v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(out, "config.json"), hf_config(cfg, eval_depth, ids))
    write_json(os.path.join(out, "generation_config.json"), {**ids, "do_sample": False})
    if hf_tok is not None:
        shutil.copyfile(tok, os.path.join(out, "tokenizer.json"))
        eos = hf_tok.eos_token
        write_json(os.path.join(out, "tokenizer_config.json"), {
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.model.max_seq_len,
            "padding_side": "left", "add_bos_token": False, "bos_token": eos, "eos_token": eos, "pad_token": eos})
    elif tok is not None:
        shutil.copyfile(tok, os.path.join(out, "tokenizer.model"))
        write_json(os.path.join(out, "tokenizer_config.json"), {
            "tokenizer_class": "FpscaleTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_fpscale.FpscaleTokenizer", None]},
            "model_max_length": cfg.model.max_seq_len, "padding_side": "left",
            "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"})
    write_code(out)
    return out


def check_tokenizer(path: str, vocab_size: int):
    """Refuse a missing tokenizer or one larger than the model; a tokenizer.json's HFTokenizer
    (fpscale.data.tokenizer), None for a SentencePiece model."""
    if not os.path.isfile(path):
        raise UserError(f"--tokenizer: no tokenizer at {path}; give the tokenizer.model or tokenizer.json the data "
                         f"was prepared with (or --no-tokenizer for a model of synthetic tokens)")
    if path.endswith(".json"):
        from fpscale.data.tokenizer import HFTokenizer
        tok = HFTokenizer(path)
        if tok.vocab_size > vocab_size:
            raise UserError(f"--tokenizer: {path} has {tok.vocab_size} tokens, more than model.vocab_size = "
                            f"{vocab_size}")
        return tok
    import sentencepiece as spm
    pieces = spm.SentencePieceProcessor(model_file=path).get_piece_size()
    if pieces > vocab_size:
        raise UserError(f"--tokenizer: {path} has {pieces} pieces, more than model.vocab_size = {vocab_size}")
    return None


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
