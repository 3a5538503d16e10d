"""Training on a blend, end to end on one process: a Hugging Face tokenizer.json made with the
``tokenizers`` library prepares a folder, megatron-core's IndexedDatasetBuilder writes a Megatron
dataset with the same tokenizer, a tiny model trains 2 steps on their 0.6 / 0.4 blend with TensorBoard
and W&B (offline) logging, validation reports each source and their weighted mean, the W&B run
holds the very scalars TensorBoard got, the HF export carries the tokenizer.json (transformers'
AutoTokenizer encodes as the tokenizers library does; the model generates), and a run cut at step
2 and resumed is bit-identical to the straight one (tests/train/test_resume.py's harness)."""
import json
import math
import os

import numpy as np
import pytest
import torch

from tests.data.conftest import corpus_file, hf_prepared, make_docs  # noqa: F401  (fixtures)
from tests.train.test_resume import train, train_records
from tests.train.wandb_records import history

transformers = pytest.importorskip("transformers")
pytest.importorskip("wandb")


@pytest.fixture(scope="module")
def megatron_hf(tmp_path_factory, hf_prepared):  # noqa: F811
    """A Megatron dataset of other documents, tokenized with hf_prepared's tokenizer.json + EOS."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(hf_prepared, "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    prefix = str(tmp_path_factory.mktemp("mega") / "web_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for enc in tok.encode_batch([d["text"] for d in make_docs(60, seed=33)], add_special_tokens=False):
        doc = np.array(enc.ids + [eos])
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def blend_overrides(prepared_folder, prefix, *extra):
    tokenizer = os.path.join(prepared_folder, "tokenizer.json")
    return ("data.source=shards", "data.seq_len=16", "model.vocab_size=320", "model.d_model=32",
            "model.max_seq_len=32", "train.micro_batch=4", "train.global_batch=4", "train.eval_batches=1",
            f"data.blend=[{{path: {prepared_folder}, weight: 0.6, name: web}}, "
            f"{{path: {prefix}, weight: 0.4, name: mega, tokenizer: {tokenizer}, val_fraction: 0.2}}]", *extra)


def tensorboard_scalars(run_dir) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


@pytest.mark.slow
def test_a_blend_trains_logs_to_wandb_and_exports_its_tokenizer(tmp_path, hf_prepared, megatron_hf, monkeypatch):  # noqa: F811
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    history_ = train(tmp_path, "blend", *blend_overrides(hf_prepared, megatron_hf, "train.steps=2",
                                                         "train.eval_interval=2", "train.loggers=[tensorboard, wandb]"))
    val = next(r for r in history_ if r["kind"] == "val")
    assert val["val_loss"] == pytest.approx(0.6 * val["val_loss_web"] + 0.4 * val["val_loss_mega"], rel=1e-12)
    assert val["val_loss_web"] != val["val_loss_mega"] and val["val_ppl_mega"] == pytest.approx(
        math.exp(val["val_loss_mega"]))

    # W&B (offline: no key) got the very scalars TensorBoard got, at the same steps, and the run config
    run_dir = tmp_path / "blend"
    import wandb
    wandb.teardown()                 # the run's service process writes the file: let it finish writing
    wandb_steps, config = history(str(run_dir))
    tb = tensorboard_scalars(run_dir)
    assert sorted(wandb_steps) == sorted(tb) == [1, 2]
    for step in tb:
        assert set(wandb_steps[step]) == set(tb[step]), step
        for tag, value in tb[step].items():          # TensorBoard stores float32
            assert np.float32(wandb_steps[step][tag]) == np.float32(value), (step, tag)
    assert {"train/loss", "val/val_loss", "val/val_loss_web", "val/val_loss_mega"} <= set(tb[2])
    data = config["data"].get("value", config["data"])          # the run record holds the config unwrapped
    assert data["blend"][1]["name"] == "mega" and config["train"]["loggers"] == ["tensorboard", "wandb"]

    # the HF export carries the data's tokenizer.json (the first source's, found from the config)
    from fpscale.hf.export import export_hf
    out = export_hf(str(run_dir / "checkpoints" / "step_00000002"), str(tmp_path / "hf"))
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(os.path.join(hf_prepared, "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for text in [d["text"] for d in make_docs(5, seed=40)] + ["plain ascii, digits 12345 and\ttabs\n"]:
        assert auto(text)["input_ids"] == ref.encode(text, add_special_tokens=False).ids
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    prompt = auto(["fixed point iteration"], return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 4)
    assert model.config.eos_token_id == ref.token_to_id("<|endoftext|>") == auto.eos_token_id


def test_a_blend_run_cut_and_resumed_is_bit_identical(tmp_path, hf_prepared, megatron_hf):  # noqa: F811
    overrides = blend_overrides(hf_prepared, megatron_hf, "train.steps=4", "train.eval_interval=4")
    train(tmp_path, "straight", *overrides)
    train(tmp_path, "sliced", *overrides, "train.stop_at=2")
    train(tmp_path, "sliced", *overrides)
    straight, sliced = train_records(tmp_path, "straight"), train_records(tmp_path, "sliced")
    assert sorted(sliced) == sorted(straight) == [1, 2, 3, 4]
    for step in straight:
        assert sliced[step]["loss"] == straight[step]["loss"] and sliced[step]["grad_norm"] == straight[step][
            "grad_norm"], step
    a, b = (torch.load(tmp_path / name / "checkpoints" / "step_00000004" / "model.pt", map_location="cpu",
                       weights_only=False) for name in ("straight", "sliced"))
    flat = [(x, y) for x, y in zip(*(torch.utils._pytree.tree_leaves(m) for m in (a, b))) if torch.is_tensor(x)]
    assert flat and all(torch.equal(x, y) for x, y in flat)
    metas = [json.load(open(tmp_path / n / "checkpoints" / "step_00000004" / "meta.json"))
             for n in ("straight", "sliced")]
    assert metas[0]["consumed_samples"] == metas[1]["consumed_samples"] == 16
    assert metas[0]["data_fingerprint"] == metas[1]["data_fingerprint"]
