"""Qwen chat format: rendering against hand-written template output, tool-call parsing in both
syntaxes, every malformed shape, budget sentence, answer convention, render/append consistency."""
import asyncio

import pytest

from megatron_search.chat.format import ChatFormat, budget_instruction, parse_tool_calls
from megatron_search.search import SearchBackend, SearchResult, SearchTool

TOOL = {"type": "function", "function": {"name": "search_web", "description": "Search the web.",
                                         "parameters": {"type": "object",
                                                        "properties": {"query": {"type": "string"}},
                                                        "required": ["query"]}}}
TOOL_JSON = ('{"type": "function", "function": {"name": "search_web", "description": "Search the web.", '
             '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}')
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who wrote The Mom Test?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "search_web", "arguments": {"query": "The Mom Test author"}}]},
    {"role": "tool", "content": "[1] The Mom Test\nURL: u\nby Rob Fitzpatrick"},
    {"role": "assistant", "content": "Rob Fitzpatrick."},
]


def test_qwen3_render_matches_template_text():
    got = ChatFormat("qwen3").render(CONVO, tools=[TOOL])
    want = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + TOOL_JSON +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWho wrote The Mom Test?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"search_web\", \"arguments\": {\"query\": \"The Mom Test author\"}}"
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n[1] The Mom Test\nURL: u\nby Rob Fitzpatrick\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nRob Fitzpatrick.<|im_end|>\n"
    )
    assert got == want


def test_qwen3_5_render_matches_template_text():
    got = ChatFormat("qwen3_5", think="closed").render(CONVO, tools=[TOOL])
    want = (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n" + TOOL_JSON +
        "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
        "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
        "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
        "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
        "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
        "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
        "the question like normal with your current knowledge and do not tell the user about function calls\n"
        "</IMPORTANT>\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWho wrote The Mom Test?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=search_web>\n<parameter=query>\n"
        "The Mom Test author\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n[1] The Mom Test\nURL: u\nby Rob Fitzpatrick\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nRob Fitzpatrick.<|im_end|>\n"
    )
    assert got == want


def test_generation_prefixes_and_plain_system():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert ChatFormat("qwen3").render(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ChatFormat("qwen3_5").generation_prefix() == "<|im_start|>assistant\n<think>\n"
    assert ChatFormat("qwen3", think="closed").generation_prefix() == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert ChatFormat("qwen3").render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_content_before_calls_and_several_calls():
    calls = [{"name": "search_web", "arguments": {"query": "a"}},
             {"function": {"name": "search_web", "arguments": {"query": "b"}}}]
    assert ChatFormat("qwen3").render_assistant_body("Let me look.", calls) == (
        'Let me look.\n<tool_call>\n{"name": "search_web", "arguments": {"query": "a"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "search_web", "arguments": {"query": "b"}}\n</tool_call>')
    assert ChatFormat("qwen3_5").render_assistant_body("Let me look.", calls) == (
        "Let me look.\n\n<tool_call>\n<function=search_web>\n<parameter=query>\na\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=search_web>\n<parameter=query>\nb\n</parameter>\n</function>\n</tool_call>")
    # Non-string XML values are JSON; consecutive tool messages share one user turn.
    assert ChatFormat("qwen3_5").render_tool_call("f", {"n": 3, "tags": ["x"]}) == (
        '<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=tags>\n["x"]\n</parameter>\n'
        "</function>\n</tool_call>")
    assert ChatFormat("qwen3").render_tool_responses(["r1", "r2"]) == (
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n</tool_response><|im_end|>\n")


def test_reasoning_dropped_before_last_query_kept_after():
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nA1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "new thought"}]
    assert ChatFormat("qwen3").render(msgs) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nA2<|im_end|>\n")


@pytest.mark.parametrize("budget, tool_choice, sentence", [
    (0, "auto", "budget of 0 tool calls"), (1, "auto", "hard budget of 1 tool call(s)"),
    (5, "auto", "hard budget of 5 tool call(s)"), (3, "none", "Tool use is disabled"),
    (None, "required", "You must call a tool"),
])
def test_budget_sentence_in_system_prompt(budget, tool_choice, sentence):
    for style in ("qwen3", "qwen3_5"):
        text = ChatFormat(style).render([{"role": "user", "content": "q"}], tools=[TOOL], budget=budget,
                                        tool_choice=tool_choice)
        system = text.split("<|im_end|>")[0]
        assert sentence in system and budget_instruction(budget, tool_choice) in system
    assert budget_instruction(None, "auto") == ""


def test_parse_both_syntaxes_in_either_style():
    json_call = '<tool_call>\n{"name": "search_web", "arguments": {"query": "x y"}}\n</tool_call>'
    xml_call = "<tool_call>\n<function=search_web>\n<parameter=query>\nx y\n</parameter>\n</function>\n</tool_call>"
    for style in ("qwen3", "qwen3_5"):
        for call_text in (json_call, xml_call):
            turn = ChatFormat(style, think="none").parse_turn("Searching.\n" + call_text + "<|im_end|>", [TOOL])
            assert [(c.name, c.arguments, c.parse_error) for c in turn.calls] == [("search_web", {"query": "x y"}, None)]
            assert turn.content == "Searching." and turn.answer is None


def test_xml_values_follow_schema_types():
    calls, _ = parse_tool_calls("<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\n7\n"
                                "</parameter>\n<parameter=o>\n{\"a\": [1]}\n</parameter>\n</function>\n</tool_call>",
                                {"f": {"n": "integer", "s": "string", "o": "object"}})
    assert calls[0].arguments == {"n": 7, "s": "7", "o": {"a": [1]}}
    multi, _ = parse_tool_calls("<tool_call>\n<function=f>\n<parameter=s>\nline one\nline two\n</parameter>\n"
                                "</function>\n</tool_call>")
    assert multi[0].arguments == {"s": "line one\nline two"}


@pytest.mark.parametrize("text, why", [
    ('<tool_call>\n{"name": "search_web", "arguments": {"query": "x"}\n</tool_call>', "invalid JSON"),
    ('<tool_call>\n{"arguments": {"query": "x"}}\n</tool_call>', '"name"'),
    ('<tool_call>\n{"name": "search_web", "args": {}}\n</tool_call>', "unexpected key"),
    ('<tool_call>\nsearch_web("x")\n</tool_call>', "JSON object or a <function"),
    ('<tool_call>\n{"name": "search_web", "arguments": {"query": "x"}}', "missing </tool_call>"),
    ("<tool_call>\n<function=search_web>\n<parameter=query>\nx\n</parameter>\n</tool_call>", "missing </function>"),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "empty function name"),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n"
     "</tool_call>", "repeated parameter"),
    ("<tool_call>\n<function=f>\nhello\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>", "unexpected text"),
    ("<function=search_web>\n<parameter=query>\nx\n</parameter>\n</function>", "outside a <tool_call>"),
    ("I am done.</tool_call>", "outside a <tool_call>"),
])
def test_malformed_calls_are_detected(text, why):
    calls, _ = parse_tool_calls(text)
    assert len(calls) == 1 and calls[0].parse_error is not None and why in calls[0].parse_error


class NoBackend(SearchBackend):
    def search(self, query, k):
        return [SearchResult("t", "u", "s", "d")]


@pytest.mark.parametrize("text, tool_choice, budget, kind", [
    ('<tool_call>\n{"name": "search_web", "arguments": {"query": "x"}\n</tool_call>', "auto", 5, "malformed"),
    ('<tool_call>\n{"name": "browse", "arguments": {"url": "x"}}\n</tool_call>', "auto", 5, "unknown_tool"),
    ('<tool_call>\n{"name": "search_web", "arguments": {"q": "x"}}\n</tool_call>', "auto", 5, "bad_arguments"),
    ("<tool_call>\n<function=search_web>\n<parameter=query>\n" + "x" * 251 + "\n</parameter>\n</function>\n"
     "</tool_call>", "auto", 5, "bad_arguments"),
    ('<tool_call>\n{"name": "search_web", "arguments": {"query": "x"}}\n</tool_call>', "none", 5, "tool_choice_none"),
    ('<tool_call>\n{"name": "search_web", "arguments": {"query": "x"}}\n</tool_call>', "auto", 0, "over_budget"),
])
def test_every_broken_class_end_to_end(text, tool_choice, budget, kind):
    """Model text -> parse -> tool session: the class is counted and an error goes back to the model."""
    tool = SearchTool(NoBackend())
    turn = ChatFormat("qwen3").parse_turn(text, [tool.spec])
    session = tool.session(budget=budget, tool_choice=tool_choice)
    (result,) = asyncio.run(session.execute_all(turn.calls))
    assert result.broken == kind and result.text.startswith("Error:")
    assert session.stats.broken[kind] == 1 and session.stats.broken_total == 1


def test_answer_convention():
    fmt = ChatFormat("qwen3", think="none")
    assert fmt.parse_turn("<think>\nhmm\n</think>\n\nParis.<|im_end|>").answer == "Paris."
    turn = fmt.parse_turn("It is <answer>Paris</answer>, I think; final: <answer> Lyon </answer><|im_end|>")
    assert turn.answer == "Lyon"
    # Calls in the reasoning are not executed; an unclosed think block has no answer.
    turn = fmt.parse_turn("<think>maybe <tool_call>\n{\"name\": \"search_web\", \"arguments\": {}}\n</tool_call>"
                          "</think>Paris<|im_end|>")
    assert turn.calls == [] and turn.answer == "Paris" and "tool_call" in turn.reasoning
    turn = ChatFormat("qwen3_5").parse_turn("still thinking about it")
    assert turn.answer is None and not turn.reasoning_closed and turn.reasoning == "still thinking about it"
    turn = ChatFormat("qwen3_5").parse_turn("ok\n</think>\n\nBerlin<|endoftext|>")
    assert turn.reasoning == "ok" and turn.answer == "Berlin"


@pytest.mark.parametrize("style, think", [("qwen3", "none"), ("qwen3", "closed"), ("qwen3_5", "open"),
                                          ("qwen3_5", "closed")])
def test_rendered_trajectory_equals_prompt_plus_turns_plus_appends(style, think):
    """SFT text of a trajectory == the text a rollout builds turn by turn (token-in/token-out layout)."""
    fmt = ChatFormat(style, think=think)
    call = {"name": "search_web", "arguments": {"query": "The Mom Test author"}}
    reasoning = "I should search." if think != "none" else None
    turns = [("", [call]), ("Rob Fitzpatrick.", [])]
    msgs = CONVO[:2] + [
        {"role": "assistant", "content": turns[0][0], "tool_calls": [call], "reasoning_content": reasoning},
        CONVO[3],
        {"role": "assistant", "content": turns[1][0], "reasoning_content": reasoning},
    ]
    think_text = {"none": "", "open": "I should search.\n</think>\n\n", "closed": ""}[think]
    if think == "closed":
        msgs[2]["reasoning_content"] = msgs[4]["reasoning_content"] = ""
    text = fmt.render(CONVO[:2], tools=[TOOL], add_generation_prompt=True)
    text += think_text + fmt.render_assistant_body(*turns[0]) + "<|im_end|>"
    text += "\n" + fmt.render_tool_responses([CONVO[3]["content"]]) + fmt.generation_prefix()
    text += think_text + fmt.render_assistant_body(*turns[1]) + "<|im_end|>\n"
    assert fmt.render(msgs, tools=[TOOL]) == text


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="chat style"):
        ChatFormat("llama")
    with pytest.raises(ValueError, match="system message must come first"):
        ChatFormat().render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="unknown role"):
        ChatFormat().render([{"role": "robot", "content": "a"}])
