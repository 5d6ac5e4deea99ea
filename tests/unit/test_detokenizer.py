import pytest

from gateway.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol.codec import files_digest
from tests.tiny_model import CORPUS


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer({p.name: p.read_bytes() for p in tiny_model.iterdir() if p.suffix == ".json"})


@pytest.mark.parametrize("text", [CORPUS[0], CORPUS[5], "😀 漢字 héllo", "a  b\n\nc"])
def test_one_token_at_a_time_gives_the_whole_text(tokenizer, text):
    ids = tokenizer.encode_text(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add([t]) for t in ids] + [detokenizer.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces[:-1])  # a split character is held until it completes


def test_several_tokens_at_once(tokenizer):
    ids = tokenizer.encode_text(CORPUS[1])
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add(ids[:5]) + detokenizer.add(ids[5:]) + detokenizer.flush() == tokenizer.decode(ids)


def test_special_tokens_are_kept_when_asked(tokenizer):
    ids = tokenizer.encode_text("<|im_start|>hi")
    assert "<|im_start|>" not in tokenizer.decode(ids)
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "<|im_start|>" in kept.add(ids) + kept.flush()


def test_the_digest_names_the_files_not_their_order():
    a = {"x": b"1", "y": b"2"}
    assert files_digest(a) == files_digest(dict(reversed(list(a.items()))))
    assert files_digest(a) != files_digest({"x": b"1", "y": b"3"})


def test_a_character_the_output_never_completed_is_flushed_as_a_full_decode_shows_it(tokenizer):
    ids = tokenizer.encode_text("a😀")
    cut = ids[:-1]  # the emoji's last byte never comes
    assert "\ufffd" in tokenizer.decode(cut)
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = detokenizer.add(cut)
    assert "\ufffd" not in streamed
    assert streamed + detokenizer.flush() == tokenizer.decode(cut)
