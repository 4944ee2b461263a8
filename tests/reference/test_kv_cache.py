"""Block manager and tokenizer unit tests."""

import pytest

from atom_kv.reference.block_manager import BlockManager, OutOfBlocks
from atom_kv.reference.tokenizer import ByteTokenizer, IncrementalDetokenizer


def test_block_manager_allocates_and_frees_fifo():
    bm = BlockManager(8, 16)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert bm.num_free == 0 and bm.num_used == 8
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free == 3 and bm.num_used == 5
    assert sorted(bm.allocate(3)) == sorted(a)


def test_block_manager_rejects_double_free():
    bm = BlockManager(4, 16)
    blocks = bm.allocate(2)
    bm.free(blocks)
    with pytest.raises(ValueError):
        bm.free(blocks[:1])
    assert bm.num_free == 4


def test_blocks_for_rounds_up():
    bm = BlockManager(4, 16)
    assert [bm.blocks_for(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("text", ["hello", "", "naïve café ✓ 漢字", "line\nbreak\ttab"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.BOS
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer()
    pieces = "".join(detok.push(i) for i in ids) + detok.flush()
    assert pieces == text


def test_chat_template_is_deterministic_and_ordered():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == tok.apply_chat_template(msgs)
    assert text.index("be brief") < text.index("hi") < text.index("<|assistant|>")
