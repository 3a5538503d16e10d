"""The Hugging Face exit (fpscale.hf): a folder transformers loads with trust_remote_code, where
fpscale is not installed, whose logits are fpscale's, whose generate() (cached, batched with left
padding) decodes what fpscale decodes, whose evaluation depth is chosen at load time, and whose
tokenizer gives fpscale's ids."""
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import save_file

import fpscale
from fpscale.data.tokenizer import train_tokenizer
from fpscale.hf.export import export_hf
from fpscale.typed import to_dict

transformers = pytest.importorskip("transformers")

CONFIGS = ["tiny_attn", "tiny_fpsa", "tiny_fpmamba", "tiny_looped", "tiny_mixed", "tiny_epsilon",
           "tiny_mixed_epsilon", "tiny_attractor"]
TEXTS = ["Fellow-Citizens of the Senate and House of Representatives: the state of the Union is strong. ",
         "def parse(text: str) -> list[int]:\n    return [int(t) for t in text.split()]  # 12345 ",
         "  Two  spaces, tabs\tand\nnewlines; unicode: é ☃ 東京. ", "The year 1790 saw 13 states and 3 bills. "]


# exports and loads with transformers (seconds each): the full suite, not the quick loop
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """A small SentencePiece model trained as fpscale trains its tokenizers."""
    folder = tmp_path_factory.mktemp("tok")
    return train_tokenizer(TEXTS * 50, str(folder / "tokenizer"), vocab_size=320, threads=1)


def weights_folder(config: str, folder, seed: int = 0, *overrides: str) -> str:
    """fpscale's exported weights of a freshly initialised model of ``configs/<config>.yaml``."""
    cfg = fpscale.load_config(f"configs/{config}.yaml", overrides)
    torch.manual_seed(seed)
    model = fpscale.build_model(cfg)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.yaml"), "w") as fh:
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
    return str(folder)


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer):
    """config name -> (fpscale model in eval mode, HF folder), made on demand."""
    done = {}

    def get(config: str):
        if config not in done:
            root = tmp_path_factory.mktemp(config)
            weights = weights_folder(config, root / "weights")
            out = export_hf(weights, str(root / "hf"), tokenizer=tokenizer)
            model, _ = __import__("fpscale.train.checkpoint", fromlist=["load_model"]).load_model(weights)
            done[config] = (model.eval(), out)
        return done[config]
    return get


def load(folder: str, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


def left_padded(rows: list[list[int]], pad_id: int = 2):
    T = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("config", CONFIGS)
@torch.no_grad()
def test_hf_logits_equal_fpscale(exported, config):
    model, folder = exported(config)
    hf = load(folder)
    assert type(hf.model).__module__.startswith("transformers_modules")      # the bundled code, not fpscale's
    tokens = torch.randint(0, 320, (3, 40), generator=torch.Generator().manual_seed(0))
    diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    assert diff < 1e-4, diff
    # batched with left padding and an attention mask: fpscale's logits of the padded batch. (That a
    # padded row computes what the row alone computes is tests/models/test_padding.py's; with a
    # loose tolerance and no freezing a solve stops when its whole batch has converged, so a row's
    # logits move with its batch-mates by up to the tolerance, padded or not.)
    rows = [tokens[0, :40].tolist(), tokens[1, :17].tolist(), tokens[2, :29].tolist()]
    ids, mask = left_padded(rows)
    logits = hf(ids, attention_mask=mask).logits
    want = model(ids, pad=(mask == 0).sum(1))
    for b, row in enumerate(rows):
        assert (logits[b, -len(row):] - want[b, -len(row):]).abs().max().item() < 1e-4, (config, b)


@pytest.mark.parametrize("overrides", [["model.layers.0.type=fpmamba2", "model.layers.0.mixer=kronecker",
                                        "model.layers.0.mixer_rank=1"],
                                       ["model.layers.0.preset=authors_state_tracking"]],
                         ids=["fpmamba2", "fpmamba-authors_state_tracking"])
@torch.no_grad()
def test_fpmamba2_and_the_authors_blocks_export(tmp_path, tokenizer, overrides):
    """tiny_fpmamba's blocks as fpmamba2 and as the authors' state-tracking block (the gate outside,
    weight norm, no conv) give fpscale's logits through the bundled code."""
    weights = weights_folder("tiny_fpmamba", tmp_path / "weights", 0, *overrides)
    model, _ = __import__("fpscale.train.checkpoint", fromlist=["load_model"]).load_model(weights)
    hf = load(export_hf(weights, str(tmp_path / "hf"), tokenizer=tokenizer))
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    assert (hf(tokens).logits - model.eval()(tokens)).abs().max().item() < 1e-4


@pytest.mark.parametrize("config", ["tiny_mixed", "tiny_mixed_epsilon"])
@torch.no_grad()
def test_greedy_generation_equals_fpscale_batched_with_padding(exported, config):
    model, folder = exported(config)
    hf = load(folder)
    rows = [[11, 40, 7, 99, 3, 250, 31, 8], [5, 77, 120], [200, 14, 9, 9, 61]]
    ids, mask = left_padded(rows)
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    pad = (mask == 0).sum(1)
    want = fpscale.generate(model, ids, 12, pad=pad)
    assert torch.equal(out, want)
    # without the cache too (every step recomputes the padded batch)
    again = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(again, fpscale.generate(model, ids, 12, pad=pad, use_cache=False))


@torch.no_grad()
def test_the_evaluation_depth_is_chosen_at_load_time(exported):
    model, folder = exported("tiny_mixed")
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    hf = load(folder, eval_depth=1)
    hf(tokens)
    assert {s.iterations for s in hf.model.layer_stats().values()} == {1}
    with model.eval_depth(1):
        assert (hf(tokens).logits - model(tokens)).abs().max().item() < 1e-4
    # per layer over the global depth; lm-evaluation-harness passes it as a string
    hf = load(folder, eval_depth=2, layer_eval_depth="1:3")
    hf(tokens)
    caps = {name: s.max_iter for name, s in hf.model.layer_stats().items()}
    assert caps["layers.1.fpsa"] == 3 and all(v == 2 for k, v in caps.items() if k != "layers.1.fpsa"), caps
    hf.config.eval_depth = None                    # back to each layer's eval_max_iter, no reload
    hf.config.layer_eval_depth = {}
    assert (hf(tokens).logits - model(tokens)).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="eval_depth must be a positive integer"):
        load(folder, eval_depth=0)(tokens)
    with pytest.raises(ValueError, match="layer_eval_depth"):
        load(folder, layer_eval_depth="1:zero")(tokens)


@torch.no_grad()
def test_generate_keeps_the_cache_mode_chosen_at_load_time(exported):
    """decode_cache (decode.cache) reaches the looped layers: generate() with fixed_point's one entry per past
    token gives fpscale.generate's tokens in that mode; a bad mode is refused naming the key."""
    model, folder = exported("tiny_mixed")
    ids = torch.randint(0, 320, (2, 10), generator=torch.Generator().manual_seed(4))
    hf = load(folder, decode_cache="fixed_point", eval_depth=2)
    out = hf.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert {m.decode_cache for m in hf.model.looped_layers().values()} == {"fixed_point"}
    with model.eval_depth(2):
        assert torch.equal(out, fpscale.generate(model, ids, 8, cache="fixed_point"))
    with pytest.raises(ValueError, match="decode_cache must be one of"):
        load(folder, decode_cache="kv")(ids)
    off = load(folder, decode_cache="fixed_point", decode_compact=False, eval_depth=2)
    assert torch.equal(off.generate(input_ids=ids, max_new_tokens=8, do_sample=False), out)
    assert {m.decode_compact for m in off.model.looped_layers().values()} == {False}
    with pytest.raises(ValueError, match="decode_compact must be true or false"):
        load(folder, decode_compact="no")(ids)


@torch.no_grad()
def test_right_padding_is_refused_with_a_clear_error(exported):
    _, folder = exported("tiny_fpsa")
    hf = load(folder)
    with pytest.raises(ValueError, match="left padding only"):
        hf(torch.tensor([[5, 6, 2]]), attention_mask=torch.tensor([[1, 1, 0]]))


def test_tokenizer_gives_fpscale_ids_and_decodes_exactly(exported, tokenizer):
    import sentencepiece as spm
    _, folder = exported("tiny_attn")
    tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    for text in TEXTS + ["a literal </s> and <s> in text", ""]:
        ids = tok(text)["input_ids"]
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text
    batch = tok(TEXTS[:2], padding=True, return_tensors="pt")
    assert tok.padding_side == "left" and tok.pad_token_id == 2
    assert batch["attention_mask"][:, -1].all()


def test_the_folder_loads_where_fpscale_is_not_installed(exported):
    """A fresh interpreter in which importing fpscale fails: the folder loads, runs and generates."""
    _, folder = exported("tiny_mixed_epsilon")
    script = f"""
import importlib.abc, sys
class NoFpscale(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fpscale" or name.startswith("fpscale."):
            raise ImportError("fpscale is not installed here")
sys.meta_path.insert(0, NoFpscale())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained({folder!r}, trust_remote_code=True)
batch = tok(["Fellow-Citizens of the Senate", "The year"], return_tensors="pt", padding=True)
out = model.generate(**batch, max_new_tokens=5, do_sample=False)
assert out.shape == (2, batch["input_ids"].shape[1] + 5)
assert not [m for m in sys.modules if m.split(".")[0] == "fpscale"]
print("ok")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(folder))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_convert_cli_writes_the_folder_and_refuses_a_missing_tokenizer(tmp_path, tokenizer, capsys):
    from fpscale.cli.convert import main
    weights = weights_folder("tiny_fpmamba", tmp_path / "weights")
    assert main(["--checkpoint", weights, "--to", "hf", "--out", str(tmp_path / "hf"), "--tokenizer", tokenizer,
                 "--eval-depth", "4"]) == 0
    assert load(str(tmp_path / "hf")).config.eval_depth == 4
    assert main(["--checkpoint", weights, "--to", "hf", "--out", str(tmp_path / "bad"),
                 "--tokenizer", str(tmp_path / "none.model")]) == 2
    assert "--tokenizer: no tokenizer at" in capsys.readouterr().err


def test_generate_cli_decodes_a_batch_of_prompts_as_each_alone(tmp_path, tokenizer, capsys):
    from fpscale.cli.generate import main
    weights = weights_folder("tiny_mixed", tmp_path / "weights", 0, "model.vocab_size=320")
    prompts = ["Fellow-Citizens of the Senate and House", "The year"]
    args = ["--model", weights, "--tokenizer", tokenizer, "--max-new-tokens", "6", "--depth", "4", "--device", "cpu"]
    assert main(args + [a for p in prompts for a in ("--prompt", p)]) == 0
    batched = capsys.readouterr().out.splitlines()
    assert len(batched) == 2 and all(line.startswith(p) for line, p in zip(batched, prompts))
    for p, line in zip(prompts, batched):
        assert main(args + ["--prompt", p]) == 0
        assert capsys.readouterr().out.splitlines() == [line]
    with pytest.raises(SystemExit):
        main(args + ["--depth", "0"])


@pytest.mark.slow               # dynamo traces the model
def test_generate_cli_compiled_with_static_caches_decodes_as_eager(tmp_path, tokenizer, capsys):
    """``--compile``: static caches and the forward under torch.compile (dynamo's eager backend here) print the
    eager fixed_point decode's text; the exact cache is refused with the key to change."""
    from fpscale.cli.generate import main
    weights = weights_folder("tiny_mixed", tmp_path / "weights", 0, "model.vocab_size=320")
    args = ["--model", weights, "--tokenizer", tokenizer, "--max-new-tokens", "5", "--device", "cpu",
            "--prompt", "Fellow-Citizens of the Senate", "--prompt", "The year"]
    assert main(args + ["--cache", "fixed_point"]) == 0
    eager = capsys.readouterr().out
    assert main(args + ["--cache", "fixed_point", "--compile", "eager"]) == 0
    assert capsys.readouterr().out == eager
    with pytest.raises(SystemExit):
        main(args + ["--cache", "exact", "--compile", "eager"])
    assert "need decode.cache: fixed_point (--cache fixed_point; this one is 'exact')" in capsys.readouterr().err
