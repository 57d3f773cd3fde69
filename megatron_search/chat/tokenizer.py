"""Tokenizers for the chat format, and the token-level chat helpers of the agent loop.

- `QwenTokenizer`: the real Qwen2/Qwen3 byte-level BPE, built offline from the 151,643 ranks
  that ship in the qwen-agent wheel (`qwen_agent/utils/qwen.tiktoken`), with Qwen's regex
  pre-tokenizer, NFC normalisation and the added tokens at their real ids. Encoding runs on
  tiktoken; `to_hf()` gives the equivalent `transformers.PreTrainedTokenizerFast`.
- `BPETokenizer`: a small byte-level BPE trained with the `tokenizers` library (the tiny
  demo model has 2,048 embeddings), same pre-tokenizer and chat special tokens; saved and
  loaded as tokenizer.json.
- `ChatEncoder`: token-in/token-out helpers: prompt ids from messages, the ids appended after
  a model turn (tool responses + the next assistant header), stop ids, turn parsing. Tool
  responses are tokenised once here and appended as ids; a transcript is never re-tokenised.

Added text tokens (`<tool_call>`, `<think>`, ...) are recognised when they occur in text,
as HF tokenizers do for added tokens.
"""
from __future__ import annotations

import base64
import importlib.util
import os
import re
import tempfile
import unicodedata
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Optional, Sequence

from megatron_search.chat.format import ChatFormat, AssistantTurn, IM_END, IM_START

# Qwen's pre-tokenizer (tokenizer.json of Qwen2/Qwen2.5/Qwen3): digits split one by one.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The tiny BPE's default pre-tokenizer: words, digits, punctuation runs and whitespace runs are
# separate pieces, so a word never carries the space before it. A name then has the same tokens
# wherever it stands (after a space, at the start of an answer, after a quote), which is what lets
# a model trained from scratch copy it from the context with an induction head. Qwen's pattern
# glues the space to the word (" Dreikym" vs "D"+"reikym" at the start of a line).
WORDS_PATTERN = r"[\p{L}\p{M}]+|\p{N}|[^\s\p{L}\p{M}\p{N}]+|\s+"
PRETOKENIZERS = ("words", "qwen")
QWEN_NUM_RANKS = 151_643
# Added tokens of Qwen2.5 / Qwen3 at their real ids, with the `special` flag of each. Source:
# `added_tokens_decoder` in the Qwen3 tokenizer_config.json (e.g. huggingface.co/Qwen/Qwen3-4B,
# the same table in Qwen3-30B-A3B), read via a public copy (github akougkas/warpio-cli,
# warpio-docs/ai-docs/model_cards/qwen3:4b.md). Tokens with special=False (<tool_call>, <think>,
# ...) are kept by decode(skip_special_tokens=True).
QWEN_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True), (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False), (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False), (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False), (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False), (151666, "</tool_response>", False),
    (151667, "<think>", False), (151668, "</think>", False),
)
# The chat tokens the tiny BPE reserves (ids 0.. in this order).
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEXT_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


class ChatTokenizer(ABC):
    """What the chat helpers and the agent loop need from a tokenizer."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`; added/special tokens written in the text map to their ids."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 from a cut multi-byte character becomes U+FFFD)."""

    @abstractmethod
    def token_to_id(self, token: str) -> int:
        """Id of one added token (KeyError if absent)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (max id + 1)."""

    @property
    def im_start_id(self) -> int:
        return self.token_to_id(IM_START)

    @property
    def im_end_id(self) -> int:
        return self.token_to_id(IM_END)

    @property
    def eos_id(self) -> int:
        """End of an assistant turn (`<|im_end|>`), the chat models' eos."""
        return self.im_end_id

    @property
    def pad_id(self) -> int:
        return self.token_to_id("<|endoftext|>")


# ---------------------------------------------------------------------------------- Qwen (real)
def find_qwen_tiktoken() -> Path:
    """Path of qwen.tiktoken inside the installed qwen-agent package (not imported: it pulls heavy deps)."""
    spec = importlib.util.find_spec("qwen_agent")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the Qwen BPE ranks ship in the qwen-agent wheel: pip install --no-deps qwen-agent")
    path = Path(spec.origin).parent / "utils" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed qwen-agent")
    return path


def load_qwen_ranks(path: Optional[str | os.PathLike] = None) -> dict[bytes, int]:
    """The BPE ranks: {token bytes: id}, checked to be exactly ids 0..151642."""
    path = Path(path) if path else find_qwen_tiktoken()
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{lineno}: expected '<base64 token> <rank>'") from None
    if len(ranks) != QWEN_NUM_RANKS or sorted(ranks.values()) != list(range(QWEN_NUM_RANKS)):
        raise ValueError(f"{path}: expected ranks 0..{QWEN_NUM_RANKS - 1}, got {len(ranks)} distinct tokens")
    return ranks


class QwenTokenizer(ChatTokenizer):
    """The real Qwen2/Qwen3 tokenizer (vocab 151,669 ids; model embeddings are padded to 151,936)."""

    def __init__(self, ranks_path: Optional[str | os.PathLike] = None):
        import tiktoken  # start-up: tiktoken (~12 ms), kept off every CLI command's start

        self.ranks = load_qwen_ranks(ranks_path)
        self.added = {tok: i for i, tok, _ in QWEN_ADDED_TOKENS}
        self._special_ids = {i for i, _, special in QWEN_ADDED_TOKENS if special}
        self._enc = tiktoken.Encoding("qwen2", pat_str=QWEN_PATTERN, mergeable_ranks=self.ranks,
                                      special_tokens=self.added)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"decode: id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return self._enc.decode(ids, errors="replace")

    def token_to_id(self, token: str) -> int:
        return self.added[token]

    @property
    def vocab_size(self) -> int:
        return QWEN_NUM_RANKS + len(QWEN_ADDED_TOKENS)

    def to_hf(self, cache: Optional[str | os.PathLike] = None):
        """The same tokenizer as a `transformers.PreTrainedTokenizerFast` (merges derived from the ranks).

        Building takes ~8 s on one CPU core; with `cache` (a tokenizer.json path) it is built
        once, written atomically, and loaded from there afterwards (~2 s).
        """
        # start-up: transformers (0.6 s) and tokenizers, kept off every CLI command's start
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        if cache is not None and Path(cache).is_file():
            tok = Tokenizer.from_file(str(cache))
        else:
            tok = self._build_hf_tokenizer()
            if cache is not None:
                _atomic_save(tok, Path(cache))
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token="<|endoftext|>",
                                       bos_token=None, unk_token=None, clean_up_tokenization_spaces=False)

    def _build_hf_tokenizer(self):
        # start-up: tokenizers (~10 ms), kept off every CLI command's start (all import this module)
        from tokenizers import AddedToken, Tokenizer, decoders, normalizers
        from tokenizers.models import BPE

        vocab, merges = ranks_to_vocab_merges(self.ranks)
        # ignore_merges: a pre-tokenized piece that is itself a vocabulary entry maps to that id
        # directly, which is what tiktoken does (the equality is tested).
        tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = _qwen_pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        # Added in id order, in one call (they take the ids right after the ranks).
        tok.add_tokens([AddedToken(text, special=special, normalized=False) for _, text, special in QWEN_ADDED_TOKENS])
        for i, text, _ in QWEN_ADDED_TOKENS:
            if tok.token_to_id(text) != i:
                raise RuntimeError(f"added token {text!r} got id {tok.token_to_id(text)}, expected {i}")
        return tok


def _qwen_pre_tokenizer(pattern: str = QWEN_PATTERN):
    # start-up: tokenizers (~10 ms), kept off every CLI command's start (all import this module)
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _atomic_save(tok, path: Path) -> None:
    """Save a `tokenizers.Tokenizer` to `path` via a temporary file + rename (no half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".json", dir=path.parent)
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def ranks_to_vocab_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks -> (HF byte-level vocab, merges ordered by the rank of the merged token).

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; listing, for
    every token, the splits into two existing tokens, ordered by the merged token's rank,
    gives an HF BPE that picks the same merges.
    """
    table = _byte_to_unicode()

    def show(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {show(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for tok, rank in ranks.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None and rl < rank and rr < rank:
                merges.append((rank, rl, rr, show(left), show(right)))
    merges.sort()
    return vocab, [(a, b) for _, _, _, a, b in merges]


# ---------------------------------------------------------------------------------- tiny BPE
class BPETokenizer(ChatTokenizer):
    """A `tokenizers` byte-level BPE with the chat tokens (the tiny demo's tokenizer)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        missing = [t for t in CHAT_SPECIAL_TOKENS + CHAT_TEXT_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the chat token(s) {missing}")
        self._special_ids = {tokenizer.token_to_id(t) for t in CHAT_SPECIAL_TOKENS}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2,
              show_progress: bool = False, pretokenizer: str = "words", words: Sequence[str] = ()) -> "BPETokenizer":
        """Train on `texts`; the vocabulary has at most `vocab_size` ids (fewer on a small corpus).
        `pretokenizer`: "words" (WORDS_PATTERN: spaces are their own tokens) or "qwen" (QWEN_PATTERN).
        The choice is saved in tokenizer.json. `words`: whole words that become one token each wherever
        they stand (added tokens, matched before the BPE; none may contain another), counted in
        `vocab_size`: the demo's invented names are then a few whole tokens (data/world.word_pool)."""
        # start-up: tokenizers (~10 ms), kept off every CLI command's start (all import this module)
        from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
        from tokenizers.models import BPE

        base = 256 + len(CHAT_SPECIAL_TOKENS) + len(CHAT_TEXT_TOKENS)
        words = list(words)
        bad = [w for w in words if not w or not w.isalpha()]
        if bad:
            raise ValueError(f"words: {bad[:3]} are not alphabetic words")
        lows = sorted({w.lower() for w in words}, key=len)
        if len(lows) != len(words):
            raise ValueError("words: a word repeats (case-insensitively)")
        inside = next(((a, b) for i, a in enumerate(lows) for b in lows[i + 1:] if a in b), None)
        if inside:
            raise ValueError(f"words: {inside[0]!r} is inside {inside[1]!r}; added tokens would split the longer one")
        if vocab_size - len(words) < base:
            raise ValueError(f"vocab_size {vocab_size} minus {len(words)} words is below the {base} bytes + chat "
                             "tokens a byte-level BPE needs")
        vocab_size -= len(words)
        if words:  # the BPE's merges go to the rest of the text, not to pieces of the words
            whole = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
            texts = (whole.sub(" ", t) for t in texts)
        if pretokenizer not in PRETOKENIZERS:
            raise ValueError(f"pretokenizer {pretokenizer!r}: expected one of {', '.join(PRETOKENIZERS)}")
        tok = Tokenizer(BPE(fuse_unk=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = _qwen_pre_tokenizer(WORDS_PATTERN if pretokenizer == "words" else QWEN_PATTERN)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
            special_tokens=list(CHAT_SPECIAL_TOKENS + CHAT_TEXT_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        if words:
            tok.add_tokens([AddedToken(w, single_word=False, lstrip=False, rstrip=False, normalized=False)
                            for w in words])
        return cls(tok)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BPETokenizer":
        from tokenizers import Tokenizer  # start-up: tokenizers (~10 ms), kept off every CLI command's start

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json (into `path` if it is a directory) atomically; returns the file."""
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path.mkdir(parents=True, exist_ok=True)
            path = path / "tokenizer.json"
        _atomic_save(self._tok, path)
        return path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"decode: id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        # Decode added tokens as their text: the tokenizers library drops special ones otherwise.
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(token)
        return i

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_hf(self):
        from transformers import PreTrainedTokenizerFast  # start-up: transformers (0.6 s), off every CLI start

        return PreTrainedTokenizerFast(tokenizer_object=self._tok, eos_token=IM_END, pad_token="<|endoftext|>",
                                       clean_up_tokenization_spaces=False)


def load_tokenizer(spec: str) -> ChatTokenizer:
    """"qwen" -> the real Qwen tokenizer; a path (file or directory) -> a saved tokenizer.json."""
    if spec == "qwen":
        return QwenTokenizer()
    return BPETokenizer.load(spec)


# ---------------------------------------------------------------------------------- chat ids
class ChatEncoder:
    """Token-level chat helpers for one (tokenizer, chat format) pair: what token-in/token-out needs.

    A rollout's ids are: `prompt_ids(...)`, then per turn the model's ids, then (if it called
    tools) `tool_response_ids(...)` (loss mask 0), and so on. Concatenated, they equal the
    tokenisation of `fmt.render(...)` of the same conversation, because every chat token is an
    added token and tokenisation never merges across added tokens.
    """

    def __init__(self, tokenizer: ChatTokenizer, fmt: ChatFormat):
        self.tokenizer = tokenizer
        self.fmt = fmt

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end an assistant turn (`<|im_end|>`, and `<|endoftext|>` as a fallback)."""
        return [self.tokenizer.im_end_id, self.tokenizer.pad_id]

    def prompt_ids(self, messages: list[dict], tools: Optional[list[dict]] = None, budget: Optional[int] = None,
                   tool_choice: str = "auto") -> list[int]:
        """The rendered conversation plus the assistant generation prefix."""
        text = self.fmt.render(messages, tools, add_generation_prompt=True, budget=budget, tool_choice=tool_choice)
        return self.tokenizer.encode(text)

    def tool_response_ids(self, responses: list[str], turn_ids: Sequence[int] = ()) -> list[int]:
        """Ids to append after a model turn that called tools: the tool-response user turn and the next
        assistant header. If the model turn (`turn_ids`) did not end in `<|im_end|>` (stopped on a
        string), that token is supplied first; the newline after `<|im_end|>` always is.
        """
        closed = len(turn_ids) > 0 and turn_ids[-1] == self.tokenizer.im_end_id
        text = ("" if closed else IM_END) + "\n" + self.fmt.render_tool_responses(responses) + self.fmt.generation_prefix()
        return self.tokenizer.encode(text)

    def parse_turn(self, turn_ids: Sequence[int], tools: Optional[list[dict]] = None) -> AssistantTurn:
        """Decode a model turn and parse it (reasoning, content, tool calls, answer)."""
        return self.fmt.parse_turn(self.tokenizer.decode(turn_ids), tools)
