"""Logprobs' tokens read as they do inside the text, leading spaces included."""

import json

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from gateway.tokenizer import Tokenizer
from tests.tiny_model import CORPUS, train_tokenizer


def sentencepiece_like() -> RustTokenizer:
    """Llama 2's and Mistral's kind: words carry their space as "▁", dropped from a text's start."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=384, show_progress=False))
    return tok


@pytest.mark.parametrize("rust", [sentencepiece_like(), train_tokenizer()], ids=["sentencepiece", "byte-level"])
def test_a_words_token_keeps_its_leading_space(rust):
    tokenizer = Tokenizer({"tokenizer.json": rust.to_str().encode(),
                           "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}).encode()})
    ids = rust.encode("the cat").ids
    pieces = [tokenizer.token_text(i) for i in ids]
    assert "".join(pieces).strip() == "the cat" and any(p.startswith(" ") for p in pieces)


def byte_fallback() -> RustTokenizer:
    """SentencePiece with byte fallback (Llama 2, Mistral): a character the vocabulary lacks is its bytes' tokens."""
    vocab = {"<unk>": 0, "a": 1, "▁": 2, **{f"<0x{b:02X}>": 3 + i for i, b in enumerate("😀".encode())}}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


@pytest.mark.parametrize("rust", [byte_fallback(), train_tokenizer()], ids=["byte-fallback", "byte-level"])
def test_tokens_that_split_a_character_give_their_own_bytes(rust):
    """OpenAI's `bytes` let a client join a character split across tokens; each part read U+FFFD's bytes."""
    tokenizer = Tokenizer({"tokenizer.json": rust.to_str().encode(),
                           "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}).encode()})
    ids = rust.encode("a😀", add_special_tokens=False).ids
    parts = [tokenizer.token_bytes(i) for i in ids]
    assert len(parts) > 2 and b"".join(parts).decode().strip() == "a😀"
    assert any("\ufffd" in tokenizer.token_text(i) for i in ids)  # the case at hand: text alone cannot say
