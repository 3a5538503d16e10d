"""FpscaleTokenizer: fpscale's SentencePiece model (BPE with byte fallback, identity
normalisation) as a transformers tokenizer. Text becomes the ids fpscale trained on: the pieces
are SentencePiece's own (``encode``), and ``decode`` joins them with SentencePiece
(``decode_pieces``), so decode(encode(text)) == text. fpscale adds no BOS: documents are joined
by EOS (``</s>``), which is also the padding token; batches pad on the left (what a decoder
generating from a batch of prompts needs).
"""
from __future__ import annotations

import os
import shutil

import sentencepiece as spm
from transformers import PreTrainedTokenizer


class FpscaleTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, unk_token: str = "<unk>", bos_token: str = "<s>", eos_token: str = "</s>",
                 pad_token: str = "</s>", padding_side: str = "left", add_bos_token: bool = False,
                 split_special_tokens: bool = True, **kwargs):
        self.vocab_file = vocab_file
        self.sp = spm.SentencePieceProcessor(model_file=vocab_file)
        super().__init__(unk_token=unk_token, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                         padding_side=padding_side, add_bos_token=add_bos_token,
                         split_special_tokens=split_special_tokens, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def get_vocab(self) -> dict[str, int]:
        vocab = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}
        vocab.update(self.added_tokens_encoder)
        return vocab

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.sp.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp.decode_pieces(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tokenizer.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
