"""Qwen chat format: render prompts / transcripts as text, parse tool calls out of model text.

Two styles, written to reproduce the official chat templates character for character
(Qwen3: the `chat_template` of the Qwen3 `tokenizer_config.json`; Qwen3.5: its
`chat_template.jinja`); the text differences that matter:

- Qwen3 (`style="qwen3"`): tools block appended to the system text, tool calls as JSON
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- Qwen3.5 (`style="qwen3_5"`): tools block first, system text after it; tool calls as XML
  `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`;
  message contents are stripped.
- Both: tool responses go back in a *user* turn, each wrapped in `<tool_response>..</tool_response>`;
  every turn is `<|im_start|>role\\n...<|im_end|>\\n`.

`think` sets the assistant generation prefix: "none" (`<|im_start|>assistant\\n`, Qwen3
Instruct-2507, or Qwen3 hybrid with thinking on: the model opens `<think>` itself), "open"
(`...<think>\\n`, Qwen3.5 default / Qwen3 Thinking-2507), "closed" (`...<think>\\n\\n</think>\\n\\n`,
enable_thinking=False).

Checked against the official templates through transformers' `apply_chat_template`
(tests/test_chat_templates_real.py; the templates in tests/fixtures/chat_templates/): identical,
text and token ids, for Qwen3.5 (think="open") and Qwen3 Instruct-2507 (think="none") on
conversations with system text, tools, parallel calls, several tool turns, multi-turn history
and reasoning; identical for the Qwen3 *hybrid* template (think="none") where the turns after
the last query carry reasoning. That template also gives a reasoning-less last assistant turn
an empty think block, which we do not (a rollout's transcript is what the model generated).

Parsing accepts both call syntaxes in either style (a policy may drift between them); a block
that cannot be read is a `ToolCall` with `parse_error` set (broken class "malformed"). Calls
inside the reasoning block are not executed (the templates and SGLang's parsers separate
reasoning first). Answer convention (docs/SEARCH.md): the final answer is the visible text
(after `</think>`) of the first assistant turn that makes no tool call; when it contains
`<answer>...</answer>`, the text of the last such tag.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_search.search.tool import ToolCall

Style = Literal["qwen3", "qwen3_5"]
Think = Literal["none", "open", "closed"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_QWEN3_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_QWEN3_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
_QWEN35_TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_QWEN35_TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
_GEN_PREFIX = {"none": "", "open": "<think>\n", "closed": "<think>\n\n</think>\n\n"}


def tojson(value: Any) -> str:
    """JSON exactly as the HF chat templates' `tojson` filter writes it (no ASCII escaping, default separators)."""
    return json.dumps(value, ensure_ascii=False)


def budget_instruction(budget: Optional[int], tool_choice: str = "auto") -> str:
    """The sentence the system prompt carries for the budget protocol (RECIPE 8) and tool_choice."""
    if tool_choice == "none":
        return "Tool use is disabled for this request: do not call any tool; answer directly."
    parts = []
    if budget is not None:
        if budget == 0:
            parts.append("You have a budget of 0 tool calls for this request: do not call any tool; "
                         "answer from your own knowledge.")
        else:
            parts.append(f"You have a hard budget of {budget} tool call(s) for this request; "
                         "calls beyond the budget fail.")
    if tool_choice == "required":
        parts.append("You must call a tool before answering.")
    return " ".join(parts)


def _call_fields(call: dict) -> tuple[str, Any]:
    """(name, arguments) of an OpenAI-style or flat tool call dict."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return fn["name"], args


@dataclass
class AssistantTurn:
    """One parsed model turn."""

    text: str  # the decoded model text, untouched
    reasoning: str  # inside <think>...</think> ("" if none)
    content: str  # visible text with tool-call blocks removed, stripped
    calls: list[ToolCall] = field(default_factory=list)
    answer: Optional[str] = None  # set on a turn without tool calls (the final answer)
    reasoning_closed: bool = True  # False when <think> was opened and never closed (truncated)


class ChatFormat:
    """Render and parse one Qwen chat style. Stateless; safe to share between rollouts."""

    def __init__(self, style: Style = "qwen3", think: Optional[Think] = None):
        if style not in ("qwen3", "qwen3_5"):
            raise ValueError(f"chat style must be 'qwen3' or 'qwen3_5', got {style!r}")
        self.style = style
        self.think: Think = think or ("open" if style == "qwen3_5" else "none")
        if self.think not in _GEN_PREFIX:
            raise ValueError(f"think must be 'none', 'open' or 'closed', got {self.think!r}")

    # ------------------------------------------------------------------ rendering
    def _content(self, text: Optional[str]) -> str:
        text = text or ""
        return text.strip() if self.style == "qwen3_5" else text

    def render_system(self, system: Optional[str], tools: Optional[list[dict]]) -> str:
        """The system turn ("" when there is neither a system text nor tools)."""
        system = self._content(system) if system is not None else None
        if not tools:
            return f"{IM_START}system\n{system}{IM_END}\n" if system is not None else ""
        specs = "".join("\n" + tojson(t) for t in tools)
        if self.style == "qwen3":
            head = system + "\n\n" if system is not None else ""
            return f"{IM_START}system\n{head}{_QWEN3_TOOLS_HEAD}{specs}{_QWEN3_TOOLS_TAIL}{IM_END}\n"
        tail = "\n\n" + system if system else ""
        return f"{IM_START}system\n{_QWEN35_TOOLS_HEAD}{specs}{_QWEN35_TOOLS_TAIL}{tail}{IM_END}\n"

    def render_tool_call(self, name: str, arguments: Any) -> str:
        """One `<tool_call>` block in this style's syntax (no surrounding newlines)."""
        if self.style == "qwen3":
            args = arguments if isinstance(arguments, str) else tojson(arguments)
            return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{TOOL_CALL_CLOSE}'
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else tojson(v)}\n</parameter>\n" for k, v in arguments.items()
        )
        return f"{TOOL_CALL_OPEN}\n<function={name}>\n{params}</function>\n{TOOL_CALL_CLOSE}"

    def render_assistant_body(self, content: str, tool_calls: list[dict] = (), reasoning: Optional[str] = None) -> str:
        """What follows `<|im_start|>assistant\\n` up to (not including) `<|im_end|>`."""
        content = self._content(content)
        out = ""
        if reasoning is not None:
            reasoning = reasoning.strip("\n") if self.style == "qwen3" else reasoning.strip()
            out = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n" + (
                content.lstrip("\n") if self.style == "qwen3" else content)
        else:
            out = content
        for i, call in enumerate(tool_calls):
            name, args = _call_fields(call)
            if self.style == "qwen3":
                sep = "\n" if (i == 0 and content) or i > 0 else ""
            else:
                sep = ("\n\n" if content.strip() else "") if i == 0 else "\n"
            out += sep + self.render_tool_call(name, args)
        return out

    def render_tool_responses(self, contents: list[str]) -> str:
        """A user turn carrying one `<tool_response>` per result (consecutive tool messages share it)."""
        body = "".join(f"\n<tool_response>\n{self._content(c)}\n</tool_response>" for c in contents)
        return f"{IM_START}user{body}{IM_END}\n"

    def generation_prefix(self) -> str:
        """The assistant header the model continues from."""
        return f"{IM_START}assistant\n{_GEN_PREFIX[self.think]}"

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = False,
               budget: Optional[int] = None, tool_choice: str = "auto") -> str:
        """A conversation as the model sees it (the chat template's output).

        `messages`: dicts with `role` in system/user/assistant/tool and `content`; assistant
        messages may carry `tool_calls` ([{"name", "arguments"}] or OpenAI {"function": {...}})
        and `reasoning_content`. Assistant turns after the last user query keep their think
        block whenever think != "none" (even an empty one), so a rendered trajectory equals the
        token transcript of the rollout that produced it (the Qwen3 template would drop an
        empty block on intermediate turns). `budget` / `tool_choice` add the budget-protocol sentence to
        the system text (tools are still listed, so calls remain possible and are classified).
        """
        if not messages:
            raise ValueError("render: no messages")
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        rest = messages[1:] if system is not None else messages
        extra = budget_instruction(budget, tool_choice) if tools else ""
        if extra:
            system = f"{system.rstrip()}\n\n{extra}" if system else extra
        out = [self.render_system(system, tools)]
        last_query = max((i for i, m in enumerate(rest) if m["role"] == "user" and not _is_tool_wrapped(m)),
                         default=-1)
        i = 0
        while i < len(rest):
            m = rest[i]
            role = m["role"]
            if role == "system":
                raise ValueError(f"render: message {i}: a system message must come first")
            if role == "user":
                out.append(f"{IM_START}user\n{self._content(m['content'])}{IM_END}\n")
            elif role == "assistant":
                reasoning = m.get("reasoning_content")
                content = m.get("content") or ""
                if reasoning is None and THINK_CLOSE in content:
                    reasoning = content.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1]
                    content = content.split(THINK_CLOSE)[-1].lstrip("\n")
                keep = i > last_query and (reasoning or self.think != "none")
                body = self.render_assistant_body(content, m.get("tool_calls") or [], (reasoning or "") if keep else None)
                out.append(f"{IM_START}assistant\n{body}{IM_END}\n")
            elif role == "tool":
                j = i
                while j < len(rest) and rest[j]["role"] == "tool":
                    j += 1
                out.append(self.render_tool_responses([r["content"] for r in rest[i:j]]))
                i = j
                continue
            else:
                raise ValueError(f"render: message {i}: unknown role {role!r}")
            i += 1
        if add_generation_prompt:
            out.append(self.generation_prefix())
        return "".join(out)

    # ------------------------------------------------------------------ parsing
    def parse_turn(self, text: str, tools: Optional[list[dict]] = None) -> AssistantTurn:
        """Split a model turn into reasoning, visible content, tool calls and (if final) the answer.

        `text` is what the model generated after the generation prefix, optionally ending in
        `<|im_end|>`. With think="open" the prefix already opened `<think>`.
        """
        body = re.split(r"<\|im_end\|>|<\|endoftext\|>", text, maxsplit=1)[0]
        reasoning, closed = "", True
        if THINK_CLOSE in body:
            reasoning, body = body.split(THINK_CLOSE, 1)
            reasoning = reasoning.split(THINK_OPEN)[-1].strip()
        elif THINK_OPEN in body or self.think == "open":
            reasoning, body, closed = body.split(THINK_OPEN)[-1].strip(), "", False
        calls, visible = parse_tool_calls(body, _param_types(tools))
        content = visible.strip()
        answer = None
        if not calls and closed:
            tagged = re.findall(r"<answer>(.*?)</answer>", content, flags=re.S)
            answer = tagged[-1].strip() if tagged else content
        return AssistantTurn(text, reasoning, content, calls, answer, closed)


def _is_tool_wrapped(m: dict) -> bool:
    c = (m.get("content") or "").strip()
    return c.startswith("<tool_response>") and c.endswith("</tool_response>")


def _param_types(tools: Optional[list[dict]]) -> dict[str, dict[str, str]]:
    """{tool name: {parameter: JSON schema type}} used to type XML parameter values."""
    out: dict[str, dict[str, str]] = {}
    for t in tools or []:
        fn = t.get("function", t)
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = {p: str(s.get("type", "string")) for p, s in props.items()}
    return out


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_XML_FN = re.compile(r"\A<function=([^>\n]*)>(.*?)</function>\Z", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)


def parse_tool_calls(text: str, param_types: Optional[dict[str, dict[str, str]]] = None
                     ) -> tuple[list[ToolCall], str]:
    """All tool calls in `text` (in order) and the text with the call blocks removed.

    A block is read as Qwen3.5 XML when it starts with `<function=`, as Qwen3 JSON when it
    starts with `{`; anything else, an unclosed block, a stray `</tool_call>` or a bare
    `<function=...>` outside a block is a malformed call.
    """
    calls: list[ToolCall] = []
    visible: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        visible.append(text[pos:m.start()])
        pos = m.end()
        raw = m.group(0)
        if not raw.endswith(TOOL_CALL_CLOSE):
            calls.append(ToolCall(None, None, raw, "missing </tool_call>"))
            continue
        calls.append(_parse_block(m.group(1).strip(), raw, param_types or {}))
    visible.append(text[pos:])
    rest = "".join(visible)
    for stray in re.finditer(r"</tool_call>|<function=[^>\n]*>", rest):
        calls.append(ToolCall(None, None, stray.group(0), f"{stray.group(0)} outside a <tool_call> block"))
    return calls, rest


def _parse_block(inner: str, raw: str, param_types: dict[str, dict[str, str]]) -> ToolCall:
    if inner.startswith("<function="):
        return _parse_xml(inner, raw, param_types)
    if inner.startswith("{"):
        try:
            obj = json.loads(inner)
        except json.JSONDecodeError as e:
            return ToolCall(None, None, raw, f"invalid JSON: {e.msg} at char {e.pos}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ToolCall(None, None, raw, 'JSON call needs a "name" string')
        unknown = sorted(set(obj) - {"name", "arguments"})
        if unknown:
            return ToolCall(None, None, raw, f"unexpected key(s) {unknown} in the call object")
        return ToolCall(obj["name"], obj.get("arguments"), raw)
    return ToolCall(None, None, raw, "a call must be a JSON object or a <function=...> block")


def _parse_xml(inner: str, raw: str, param_types: dict[str, dict[str, str]]) -> ToolCall:
    m = _XML_FN.match(inner)
    if m is None:
        return ToolCall(None, None, raw, "missing </function>")
    name = m.group(1).strip()
    if not name:
        return ToolCall(None, None, raw, "empty function name")
    types = param_types.get(name, {})
    args: dict[str, Any] = {}
    pos = 0
    body = m.group(2)
    for p in _XML_PARAM.finditer(body):
        if body[pos:p.start()].strip():
            return ToolCall(None, None, raw, f"unexpected text {body[pos:p.start()].strip()[:40]!r} between parameters")
        pos = p.end()
        key, value = p.group(1).strip(), p.group(2)
        if not key or key in args:
            return ToolCall(None, None, raw, f"empty or repeated parameter name {key!r}")
        args[key] = _typed(value, types.get(key, "string"))
    if body[pos:].strip():
        return ToolCall(None, None, raw, f"unexpected text {body[pos:].strip()[:40]!r} in <function>")
    return ToolCall(name, args, raw)


def _typed(value: str, schema_type: str) -> Any:
    """XML parameter values are text; non-string schema types are read as JSON when they parse."""
    if schema_type == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
