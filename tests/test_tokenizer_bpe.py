"""The tiny demo tokenizer: a byte-level BPE trained with `tokenizers`, vocab <= 2048, chat tokens."""
import random

import pytest

from megatron_search.chat.tokenizer import CHAT_SPECIAL_TOKENS, CHAT_TEXT_TOKENS, BPETokenizer, load_tokenizer

WORDS = ("river city capital founded author book startup accelerator launched cohort question answer search "
         "result museum painter novel physicist prize award mountain island language population").split()


def corpus(n=3000, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) + f" in {rng.randint(1800, 2025)}."
            for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return BPETokenizer.train(corpus(), vocab_size=2048)


def test_vocab_and_chat_token_ids(tok):
    assert tok.vocab_size <= 2048
    expected = {t: i for i, t in enumerate(CHAT_SPECIAL_TOKENS + CHAT_TEXT_TOKENS)}
    assert {t: tok.token_to_id(t) for t in expected} == expected
    assert (tok.pad_id, tok.im_start_id, tok.im_end_id) == (0, 1, 2)
    assert tok.encode("<|im_start|>assistant\n<tool_call>") [0] == 1
    assert tok.encode("</think>") == [expected["</think>"]]


def test_round_trip_on_unseen_text(tok):
    # Byte-level: any text round-trips, including characters never seen in training.
    for text in ["river city founded in 1850.", "Ångström 🚀 中文 <|im_end|>\n", "  spaces\tand\nlines  "]:
        assert tok.decode(tok.encode(text)) == text
    # Frequent words compress: training did merge.
    assert len(tok.encode("accelerator")) == 1
    assert tok.decode([1, 5, 2], skip_special_tokens=True) == "<tool_response>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_words_pretokenizer_keeps_a_word_s_tokens_everywhere(tok):
    # The default ("words") splits spaces off: a name copied from the context into an answer (at the
    # start of a line, after a quote) has the same ids as where it was read.
    space = tok.encode(" ")
    for word in ["accelerator", "Zorblatquenix", "museum"]:
        ids = tok.encode(word)
        assert tok.encode(f"the {word}.") == tok.encode("the") + space + ids + tok.encode(".")
        assert tok.encode(f'"{word}"')[1:-1] == ids and tok.encode(f"\n{word}")[1:] == ids
    # Qwen's pattern glues the space to the word: " accelerator" is one id, "accelerator" another.
    qwen = BPETokenizer.train(corpus(), vocab_size=2048, pretokenizer="qwen")
    assert len(qwen.encode(" accelerator")) == 1 and qwen.encode(" accelerator") != qwen.encode("accelerator")
    assert qwen.decode(qwen.encode("  spaces\tand\nlines  ")) == "  spaces\tand\nlines  "
    with pytest.raises(ValueError, match="pretokenizer 'bert'"):
        BPETokenizer.train(corpus(10), pretokenizer="bert")


def test_save_load_and_hf(tok, tmp_path):
    path = tok.save(tmp_path / "tiny")
    assert path == tmp_path / "tiny" / "tokenizer.json" and path.is_file()
    again = load_tokenizer(str(tmp_path / "tiny"))
    text = "<|im_start|>user\nwhich painter won the prize in 1901?<|im_end|>\n"
    assert again.encode(text) == tok.encode(text)
    hf = tok.to_hf()
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token_id == tok.im_end_id


def test_errors():
    with pytest.raises(ValueError, match="vocab_size 100"):
        BPETokenizer.train(["a b c"], vocab_size=100)
    with pytest.raises(FileNotFoundError):
        BPETokenizer.load("/nonexistent/tokenizer.json")


def test_train_tokenizer_cli(tmp_path, capsys):
    import json

    from megatron_search.cli import main

    path = tmp_path / "c.jsonl"
    corpus_texts = corpus(500)
    path.write_text("".join(json.dumps({"id": str(i), "title": "T", "url": "u", "text": t}) + "\n"
                              for i, t in enumerate(corpus_texts)))
    rc = main(["train-tokenizer", "--corpus", str(path), "--out", str(tmp_path / "tok"), "--vocab-size", "600"])
    assert rc == 0 and "trained on 500 documents" in capsys.readouterr().out
    tok = BPETokenizer.load(tmp_path / "tok")
    assert tok.vocab_size <= 600 and tok.decode(tok.encode(corpus_texts[0])) == corpus_texts[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    assert main(["train-tokenizer", "--corpus", str(bad), "--out", str(tmp_path / "t2")]) == 2
    assert "bad.jsonl:1: no text field" in capsys.readouterr().err


def test_words_become_one_token_each_and_take_their_share_of_the_vocabulary():
    words = ["Zorblat", "Quenix", "Drothis", "Moumous"]
    texts = [t + " Zorblat Quenix wrote about Drothis." for t in corpus()]
    tok = BPETokenizer.train(texts, vocab_size=320, words=words)
    assert tok.vocab_size == 320  # 316 BPE ids + 4 words
    space = tok.encode(" ")
    for w in words:
        ids = tok.encode(w)
        assert len(ids) == 1 and tok.decode(ids) == w
        # one and the same id at the start of a line, after a space, inside quotes, before punctuation
        assert tok.encode(f"the {w}.") == tok.encode("the") + space + ids + tok.encode(".")
        assert tok.encode(f'"{w}"')[1:-1] == ids and tok.encode(f"\n{w}")[1:] == ids
    # the BPE spent no merge on the words' letters: the lowercase form stays in pieces
    assert len(tok.encode("zorblat")) > 1
    text = '{"query": "The Silent Drothis"} Moumous Quenix.'
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="'drothis' is inside 'drothisk'"):
        BPETokenizer.train(corpus(10), vocab_size=600, words=["Drothisk", "Drothis"])
    with pytest.raises(ValueError, match="repeats"):
        BPETokenizer.train(corpus(10), vocab_size=600, words=["Drothis", "drothis"])
    with pytest.raises(ValueError, match="not alphabetic"):
        BPETokenizer.train(corpus(10), vocab_size=600, words=["Dro this"])
    with pytest.raises(ValueError, match="minus 400 words"):
        BPETokenizer.train(corpus(10), vocab_size=600, words=[f"W{chr(97 + i // 26)}{chr(97 + i % 26)}x"
                                                              for i in range(400)])
