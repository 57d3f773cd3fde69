"""Chat format round trips with the real Qwen tokenizer (both call syntaxes) and the token-in/
token-out layout of ChatEncoder: prompt + model turns + appended tool responses == encode(render)."""
import asyncio
import unicodedata

import pytest
from hypothesis import given, settings, strategies as st

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import ChatEncoder, QwenTokenizer
from megatron_search.search import SearchBackend, SearchResult, SearchTool

QUERIES = ["The Mom Test author", 'quote "inside" and \\ backslash', "数字 2005 年 Ångström", "two\nlines"]


class EchoBackend(SearchBackend):
    def search(self, query, k):
        return [SearchResult(f"About {query}", "https://e/1", f"Snippet for {query}.", "1")]


@pytest.fixture(scope="module")
def qwen():
    return QwenTokenizer()


@pytest.fixture(scope="module")
def tool():
    return SearchTool(EchoBackend())


@pytest.mark.parametrize("style", ["qwen3", "qwen3_5"])
def test_render_encode_decode_parse_recovers_calls(qwen, tool, style):
    fmt = ChatFormat(style, think="closed")
    enc = ChatEncoder(qwen, fmt)
    calls = [{"name": "search_web", "arguments": {"query": q}} for q in QUERIES]
    body = fmt.render_assistant_body("I will search.", calls)
    model_ids = qwen.encode(body + "<|im_end|>")  # what the engine would return for this turn
    assert model_ids.count(151657) == len(calls) and model_ids.count(151658) == len(calls)  # one id per tag
    assert model_ids[-1] == qwen.im_end_id
    turn = enc.parse_turn(model_ids, [tool.spec])
    assert [(c.name, c.arguments, c.parse_error) for c in turn.calls] == [
        ("search_web", {"query": q}, None) for q in QUERIES]
    assert turn.content == "I will search." and turn.answer is None
    # The whole conversation survives render -> encode -> decode unchanged.
    msgs = [{"role": "user", "content": "Who wrote it?"},
            {"role": "assistant", "content": "I will search.", "tool_calls": calls},
            {"role": "tool", "content": "r"}, {"role": "assistant", "content": "Rob."}]
    text = fmt.render(msgs, tools=[tool.spec], budget=4)
    assert qwen.decode(qwen.encode(text)) == text


@pytest.mark.parametrize("style, think", [("qwen3", "none"), ("qwen3_5", "open"), ("qwen3_5", "closed")])
def test_token_layout_equals_tokenised_render(qwen, tool, style, think):
    """prompt_ids + turn ids + tool_response_ids + turn ids == encode(render(trajectory))."""
    fmt = ChatFormat(style, think=think)
    enc = ChatEncoder(qwen, fmt)
    system = {"role": "system", "content": "You answer with search."}
    user = {"role": "user", "content": "Which accelerator launched in March 2005?"}
    reasoning = "Search first." if think == "open" else ("" if think == "closed" else None)
    lead = "Search first.\n</think>\n\n" if think == "open" else ""
    call = {"name": "search_web", "arguments": {"query": "accelerator launched March 2005"}}

    ids = enc.prompt_ids([system, user], tools=[tool.spec], budget=2)
    turn1 = qwen.encode(lead + fmt.render_assistant_body("", [call]) + "<|im_end|>")
    parsed = enc.parse_turn(turn1, [tool.spec])
    session = tool.session(budget=2)
    results = asyncio.run(session.execute_all(parsed.calls))
    assert results[0].ok and session.stats.calls == 1
    append = enc.tool_response_ids([r.text for r in results], turn1)
    turn2 = qwen.encode(lead + "Y Combinator.<|im_end|>")
    final = enc.parse_turn(turn2, [tool.spec])
    assert final.answer == "Y Combinator." and final.calls == []

    msgs = [system, user,
            {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": reasoning},
            {"role": "tool", "content": results[0].text},
            {"role": "assistant", "content": "Y Combinator.", "reasoning_content": reasoning}]
    full = qwen.encode(fmt.render(msgs, tools=[tool.spec], budget=2))
    assert ids + turn1 + append + turn2 == full[:-1]  # the rendered text ends with the "\n" after <|im_end|>
    assert full[-1] == qwen.encode("\n")[0]
    # The appended ids start with "\n" (the model produced <|im_end|>) and end in the assistant header.
    assert append[0] == qwen.encode("\n")[0]
    assert qwen.decode(append).endswith(fmt.generation_prefix())


def test_append_supplies_im_end_when_the_model_stopped_on_a_string(qwen):
    enc = ChatEncoder(qwen, ChatFormat("qwen3"))
    turn = qwen.encode('<tool_call>\n{"name": "search_web", "arguments": {"query": "x"}}\n</tool_call>')
    append = enc.tool_response_ids(["result"], turn)
    assert append[:2] == [qwen.im_end_id, qwen.encode("\n")[0]]
    assert qwen.decode(append) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\nresult\n</tool_response>"
                                   "<|im_end|>\n<|im_start|>assistant\n")
    assert enc.stop_ids == [151645, 151643]


# Any query text without "<" (which could spell a tag or a special token) survives
# render -> encode (real Qwen BPE, NFC) -> decode -> parse in both call syntaxes.

_QUERY = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<"), min_size=1,
                 max_size=60)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(query=_QUERY, content=_QUERY, style=st.sampled_from(["qwen3", "qwen3_5"]))
def test_call_round_trip_property(qwen, tool, query, content, style):
    fmt = ChatFormat(style, think="none")
    body = fmt.render_assistant_body(content, [{"name": "search_web", "arguments": {"query": query}}])
    turn = ChatEncoder(qwen, fmt).parse_turn(qwen.encode(body + "<|im_end|>"), [tool.spec])
    assert [(c.name, c.arguments, c.parse_error) for c in turn.calls] == [
        ("search_web", {"query": unicodedata.normalize("NFC", query)}, None)]
