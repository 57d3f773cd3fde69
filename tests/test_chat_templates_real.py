"""Our chat renderer and parser against the models' own chat templates, rendered by transformers.

The templates in tests/fixtures/chat_templates/ are the official ones, byte for byte (provenance in that
folder's README): Qwen3 hybrid thinking (Qwen3-30B-A3B / 235B-A22B), Qwen3 Instruct-2507, and Qwen3.5. Each is
put in an HF directory the way its model ships it (Qwen3: tokenizer_config.json's chat_template; Qwen3.5:
chat_template.jinja) beside a tokenizer.json, loaded with AutoTokenizer, and `apply_chat_template` is the
reference: system prompts, tool definitions, single and parallel tool calls, tool results, multi-turn history
with reasoning, the generation prompt. The token ids must match too (same tokenizer.json, our encoder vs
transformers'), and our parser must read back every call the template wrote.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _sft_helpers import train_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TOOLS = [
    {"type": "function", "function": {"name": "search_web", "description": "Search the web.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "open_page", "description": "Open a page by URL.", "parameters": {
        "type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}}},
]
SYSTEM = {"role": "system", "content": "You are a search agent. Cite sources."}


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _conversations(reasoning_after_last_query: bool) -> dict[str, tuple[list[dict], list | None, bool]]:
    """name -> (messages, tools, add_generation_prompt). The hybrid Qwen3 template gives the last assistant turn
    after the last query a think block even when it has no reasoning: those turns carry reasoning there."""
    think = {"reasoning_content": "The user wants a year."} if reasoning_after_last_query else {}
    think2 = {"reasoning_content": "Found it in [1]."} if reasoning_after_last_query else {}
    first = [SYSTEM, {"role": "user", "content": "When was Quessa founded?"}]
    tool_turn = [
        {"role": "assistant", "content": "Let me search.", "tool_calls": [_call("search_web", query="Quessa founded")],
         **think},
        {"role": "tool", "name": "search_web", "content": "[1] Quessa - Quessa was founded in 1907."},
    ]
    parallel = [
        {"role": "assistant", "content": "", "tool_calls": [_call("search_web", query="Quessa founded", k=3),
                                                           _call("open_page", url="https://e.org/quessa")], **think},
        {"role": "tool", "name": "search_web", "content": "[1] Quessa was founded in 1907."},
        {"role": "tool", "name": "open_page", "content": "Quessa (founded 1907) is a town."},
    ]
    final = {"role": "assistant", "content": "Quessa was founded in <answer>1907</answer>.", **think2}
    history = [SYSTEM, {"role": "user", "content": "Who founded Varnholt?"},
               {"role": "assistant", "content": "", "tool_calls": [_call("search_web", query="Varnholt founder")],
                "reasoning_content": "Earlier reasoning, dropped from the history."},
               {"role": "tool", "name": "search_web", "content": "[1] Varnholt was founded by Ana Obrask."},
               {"role": "assistant", "content": "Ana Obrask.", "reasoning_content": "Dropped too."},
               {"role": "user", "content": "And when was Quessa founded?"}]
    return {
        "system_and_question": (first, None, True),
        "tools_prompt": (first, TOOLS, True),
        "tools_without_system": (first[1:], TOOLS, True),
        "tool_call_and_result": ([*first, *tool_turn], TOOLS, True),
        "parallel_calls_two_results": ([*first, *parallel], TOOLS, True),
        "full_trajectory": ([*first, *tool_turn, final], TOOLS, False),
        "multi_turn_history": ([*history, *tool_turn, final], TOOLS, False),
    }


# template file -> (style, think mode of its default generation prompt, how the model's directory holds it)
MODELS = {
    "qwen3.jinja": ("qwen3", "none", "tokenizer_config.json"),
    "qwen3_instruct_2507.jinja": ("qwen3", "none", "tokenizer_config.json"),
    "qwen3_5.jinja": ("qwen3_5", "open", "chat_template.jinja"),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One HF directory per template: the tiny tokenizer.json and the template where that model keeps it."""
    base = tmp_path_factory.mktemp("chat_templates")
    train_tokenizer(base)
    out = {}
    for name, (_, _, where) in MODELS.items():
        d = base / name.removesuffix(".jinja")
        d.mkdir()
        shutil.copy(base / "tokenizer.json", d / "tokenizer.json")
        template = (TEMPLATES / name).read_text()
        if where == "chat_template.jinja":
            (d / "chat_template.jinja").write_text(template)
        else:
            (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        out[name] = d
    return out


def _cases():
    for name, (style, _, _) in MODELS.items():
        # the Instruct and Qwen3.5 templates need no reasoning to match; the hybrid needs it after the last query
        for case in _conversations(reasoning_after_last_query=name == "qwen3.jinja"):
            yield pytest.param(name, case, id=f"{name.removesuffix('.jinja')}-{case}")


@pytest.mark.parametrize("template,case", list(_cases()))
def test_render_equals_apply_chat_template(model_dirs, template, case):
    from transformers import AutoTokenizer

    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer

    style, think, _ = MODELS[template]
    messages, tools, gen = _conversations(template == "qwen3.jinja")[case]
    hf = AutoTokenizer.from_pretrained(str(model_dirs[template]))
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    got = ChatFormat(style, think).render(messages, tools, add_generation_prompt=gen)
    assert got == want
    ids = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen, return_dict=True)
    assert BPETokenizer.load(model_dirs[template]).encode(got) == list(ids["input_ids"])


@pytest.mark.parametrize("template", list(MODELS))
def test_parser_reads_back_every_call_the_template_wrote(model_dirs, template):
    from transformers import AutoTokenizer

    from megatron_search.chat.format import ChatFormat

    style, think, _ = MODELS[template]
    hf = AutoTokenizer.from_pretrained(str(model_dirs[template]))
    fmt = ChatFormat(style, think)
    for case, (messages, tools, _) in _conversations(template == "qwen3.jinja").items():
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or not m.get("tool_calls"):
                continue
            text = hf.apply_chat_template(messages[:i + 1], tools=tools, tokenize=False)
            body = text.rsplit("<|im_start|>assistant\n", 1)[1]  # the last turn as the model wrote it
            if think == "open":
                body = body.removeprefix("<think>\n")  # the generation prompt opened the block
            turn = fmt.parse_turn(body, tools)
            want = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            assert [(c.name, c.arguments) for c in turn.calls] == want, (case, body)
            assert all(c.parse_error is None for c in turn.calls) and turn.answer is None


def test_the_template_in_the_model_directory_sets_the_chat_style(model_dirs, tmp_path):
    from megatron_search.config import ConfigError, load_config

    repo = Path(__file__).resolve().parents[1]
    qwen3 = tmp_path / "qwen3_moe"
    shutil.copytree(model_dirs["qwen3.jinja"], qwen3)
    shutil.copy(repo / "configs" / "models" / "tiny_qwen3_moe" / "config.json", qwen3 / "config.json")
    assert load_config(None, [f"model.path={qwen3}", "model.hf_config="]).model.chat_style == "qwen3"
    # a qwen3_moe whose template writes XML calls (as Qwen3-Coder's does): the template is what the model was
    # trained on, so it sets the style, and the model_type's JSON style is refused
    (qwen3 / "tokenizer_config.json").unlink()
    shutil.copy(TEMPLATES / "qwen3_5.jinja", qwen3 / "chat_template.jinja")
    assert load_config(None, [f"model.path={qwen3}", "model.hf_config="]).model.chat_style == "qwen3_5"
    with pytest.raises(ConfigError, match=r"model.chat_style: 'qwen3' .*chat template .* writes tool calls as 'qwen3_5'"):
        load_config(None, [f"model.path={qwen3}", "model.hf_config=", "model.chat_style=qwen3"])
