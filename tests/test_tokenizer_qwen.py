"""The real Qwen2/Qwen3 tokenizer built offline from qwen-agent's qwen.tiktoken.

Known ids are checked by hand (Qwen's published ids; printable ASCII byte b has rank b - 33),
and the HF `PreTrainedTokenizerFast` built from merges is checked against tiktoken (a second
implementation of the same BPE).
"""
import pytest

from megatron_search.chat.tokenizer import QWEN_ADDED_TOKENS, QwenTokenizer

TEXTS = [
    "Hello world",
    "The Mom Test was written by Rob Fitzpatrick; Y Combinator launched in March 2005.",
    "  leading spaces,\ttabs\n\nnew lines\r\n and trailing   ",
    "数字 12345 和中文混合, emojis 🚀🔥, accents: café naïve Ångström, Привет мир, مرحبا",
    'def f(x):\n    return {"query": x, "k": 10}  # code\n',
    "I'm sure they'll say we've done it, it's OK'S",
    "<|im_start|>user\n<tool_call>\n{\"name\": \"search_web\"}\n</tool_call><|im_end|>\n<think>\n\n</think>",
]


@pytest.fixture(scope="module")
def qwen():
    return QwenTokenizer()


def test_known_ids(qwen):
    assert qwen.encode("Hello world") == [9707, 1879]
    assert qwen.encode("!") == [0]
    assert qwen.encode("12345") == [ord(c) - 33 for c in "12345"]  # Qwen splits digits one by one
    assert qwen.vocab_size == 151_669
    assert (qwen.pad_id, qwen.im_start_id, qwen.im_end_id, qwen.eos_id) == (151643, 151644, 151645, 151645)
    for token, i in [("<tool_call>", 151657), ("</tool_call>", 151658), ("<tool_response>", 151665),
                     ("</tool_response>", 151666), ("<think>", 151667), ("</think>", 151668)]:
        assert qwen.encode(token) == [i] and qwen.token_to_id(token) == i and qwen.decode([i]) == token
    assert [i for i, _, _ in QWEN_ADDED_TOKENS] == list(range(151643, 151669))


def test_round_trip_and_nfc(qwen):
    for text in TEXTS:
        assert qwen.decode(qwen.encode(text)) == text
    assert qwen.encode("cafe\u0301") == qwen.encode("caf\u00e9")  # NFC normalisation as in tokenizer.json
    assert qwen.decode([151644, 872, 151645], skip_special_tokens=True) == "user"
    assert qwen.decode([151667, 151668], skip_special_tokens=True) == "<think></think>"  # not special in Qwen
    with pytest.raises(ValueError, match="outside the vocabulary"):
        qwen.decode([151669])


def test_hf_fast_tokenizer_matches_tiktoken(qwen, tmp_path):
    cache = tmp_path / "qwen2_tokenizer.json"
    hf = qwen.to_hf(cache=cache)
    assert cache.is_file()
    for text in TEXTS:
        ids = qwen.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf.decode(ids) == text
    assert hf.eos_token_id == 151645 and hf.pad_token_id == 151643
    assert len(hf) == 151_669
