"""Tokenizers preparation encodes with: a SentencePiece ``.model`` (fpscale trains one when none is
given) or a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library, read from the file: no hub).

    tok = load_tokenizer("cache/corpus/tokenizer.model")       # or ".../tokenizer.json"
    tok.encode(["some text", "more"])     # [[ids...], [ids...]], no special tokens added
    tok.vocab_size, tok.eos_id, tok.special_tokens              # what metadata.json records

Every document is written followed by ``eos_id``: SentencePiece's ``</s>``; for a tokenizer.json
the ``eos_token`` asked for, else the first of ``EOS_CANDIDATES`` it holds.
"""
from __future__ import annotations

import os

from fpscale.errors import DataError
from fpscale.files import sha256_file

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")


class SentencePieceTokenizer:
    kind, file_name = "sentencepiece", "tokenizer.model"

    def __init__(self, path: str):
        import sentencepiece as spm
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id()
        self.eos_token = self.sp.id_to_piece(self.eos_id)
        self.special_tokens = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)
                               if self.sp.is_control(i) or self.sp.is_unknown(i)}

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids) -> str:
        return self.sp.decode(list(map(int, ids)))


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library; encodes without special tokens."""
    kind, file_name = "hf", "tokenizer.json"

    def __init__(self, path: str, eos_token: str | None = None):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # workers are forked processes
        from tokenizers import Tokenizer
        self.path = path
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as exc:        # the Rust parser's message says where the JSON is wrong
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {t.content: int(i) for i, t in sorted(self.tok.get_added_tokens_decoder().items())
                               if t.special}
        vocab = self.tok.get_vocab(with_added_tokens=True)
        if eos_token is None:
            eos_token = next((t for t in EOS_CANDIDATES if t in vocab), None)
            if eos_token is None:
                raise DataError(f"{path} holds none of the usual end-of-document tokens ({', '.join(EOS_CANDIDATES)}); "
                                f"name the one that ends a document with --eos-token")
        elif eos_token not in vocab:
            raise DataError(f"--eos-token {eos_token!r} is not in the vocabulary of {path}")
        self.eos_token, self.eos_id = eos_token, int(vocab[eos_token])

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=False)


def load_tokenizer(path: str, eos_token: str | None = None):
    """The tokenizer in ``path``: a ``.json`` file is a Hugging Face tokenizer, anything else SentencePiece."""
    if not os.path.isfile(path):
        raise DataError(f"tokenizer not found: {path}")
    if path.endswith(".json"):
        return HFTokenizer(path, eos_token)
    if eos_token is not None:
        raise DataError(f"--eos-token applies to a tokenizer.json; {path} is a SentencePiece model (its EOS is </s>)")
    return SentencePieceTokenizer(path)


def tokenizer_record(tok) -> dict:
    """What metadata.json records of the tokenizer (beside ``tokenizer_sha256`` and ``vocab_size``)."""
    return {"kind": tok.kind, "file": tok.file_name, "eos_token": tok.eos_token,
            "special_tokens": tok.special_tokens}


def train_tokenizer(texts: list[str], prefix: str, vocab_size: int, threads: int = 2) -> str:
    """SentencePiece BPE with byte fallback and identity normalisation: decode(encode(t)) == t.

    SentencePiece records its input and output paths inside the model file; training runs in
    the output folder with relative names so the file depends only on the data and settings.
    """
    import sentencepiece as spm

    folder, name = os.path.split(os.path.abspath(prefix))
    sample = f"{name}.sample.txt"
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with open(sample, "w", encoding="utf-8") as fh:
            for text in texts:
                fh.write(text.replace("\r", "") + "\n")
        spm.SentencePieceTrainer.train(
            input=sample, model_prefix=name, vocab_size=vocab_size, model_type="bpe",
            character_coverage=0.9995, byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
            num_threads=threads, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            max_sentence_length=16384, train_extremely_large_corpus=False)
    finally:
        if os.path.exists(sample):
            os.unlink(sample)
        os.chdir(cwd)
    return prefix + ".model"


def token_dtype(n_vocab: int, requested: str | None = None) -> str:
    """uint16 when the vocabulary fits, else uint32; a requested dtype must hold every id."""
    fits16 = n_vocab <= 2 ** 16
    dtype = requested or ("uint16" if fits16 else "uint32")
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"dtype must be uint16 or uint32, got {dtype!r}")
    if dtype == "uint16" and not fits16:
        raise DataError(f"the tokenizer has {n_vocab} pieces, which do not fit uint16 (at most 65536); use uint32")
    return dtype


def tokenizer_identity(path: str) -> tuple[str, int]:
    """(sha256, vocabulary size) of a tokenizer file: what a blend compares between its sources."""
    return sha256_file(path), load_tokenizer(path).vocab_size


# -- in the worker processes of preparation ----------------------------------------------------------

_TOK = None


def _init_worker(path: str, eos_token: str | None = None) -> None:
    global _TOK
    _TOK = load_tokenizer(path, eos_token)


def _encode_unit(args):
    """Tokenize one unit: returns (unit index, [(is_val, ids + [eos])])."""
    from fpscale.data.writer import is_validation
    unit, docs, val_fraction = args
    ids = _TOK.encode([text for _, text in docs])
    return unit, [(is_validation(doc_id, val_fraction), tok + [_TOK.eos_id]) for (doc_id, _), tok in zip(docs, ids)]
