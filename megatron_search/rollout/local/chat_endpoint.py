"""OpenAI-compatible /v1/chat/completions for the local engine server (as SGLang serves it).

Used by the data and eval helpers as a plain LLM endpoint. Messages (and tools) are rendered with
the Qwen chat format and tokenised with the project tokenizer; the model's turn is parsed back
into content, reasoning_content and tool_calls. Only n=1, non-streaming, string contents.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import ChatEncoder, ChatTokenizer, load_tokenizer
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.local.http_input import BadRequest, field, read_json


def _check_function(item, where: str) -> dict:
    """The function object of an OpenAI tool or tool call ({"function": {"name": ...}} or flat), checked."""
    fn = item.get("function", item) if isinstance(item, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where} must be an object with function.name (a string)")
    if not isinstance(fn.get("arguments", {}), (dict, str)):
        raise ValueError(f"{where}: function.arguments must be an object or a JSON string")
    return fn


class ChatEndpoint:
    """Renders, generates through the server's engine, parses."""

    def __init__(self, tokenizer: ChatTokenizer | str, fmt: ChatFormat, model_name: str, default_max_tokens: int):
        self._tokenizer = tokenizer  # a tokenizer, or a load_tokenizer spec loaded on first use
        self._encoder: ChatEncoder | None = None
        self.fmt = fmt
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.engine = None  # the Engine that generates; attached by local_server.build_app

    @classmethod
    def from_config(cls, cfg, tokenizer_spec: str | None = None) -> "ChatEndpoint":
        """Tokenizer `tokenizer_spec` or model.tokenizer, chat style model.chat_style."""
        return cls(tokenizer_spec or cfg.model.tokenizer, ChatFormat(cfg.model.chat_style), str(cfg.model.hf_config),
                   cfg.eval.max_new_tokens)

    @property
    def encoder(self) -> ChatEncoder:
        if self._encoder is None:
            tok = load_tokenizer(self._tokenizer) if isinstance(self._tokenizer, str) else self._tokenizer
            self._encoder = ChatEncoder(tok, self.fmt)
        return self._encoder

    def _request(self, body: dict) -> tuple[GenerateRequest, list | None]:
        where = "/v1/chat/completions"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"{where}: messages[{i}] needs a 'role'")
            if m.get("content") is not None and not isinstance(m["content"], str):
                raise ValueError(f"{where}: messages[{i}].content must be a string (content parts are not supported)")
            if m["role"] in ("user", "tool") and "content" not in m:
                raise ValueError(f"{where}: messages[{i}] ({m['role']}) needs a 'content'")
            if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
                raise ValueError(f"{where}: messages[{i}].reasoning_content must be a string")
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{where}: messages[{i}].tool_calls must be a list")
            for j, c in enumerate(calls):
                _check_function(c, f"{where}: messages[{i}].tool_calls[{j}]")
        if field(body, "stream", bool, False, where):
            raise ValueError(f"{where}: stream=true is not supported by the local engine")
        if field(body, "n", int, 1, where) != 1:
            raise ValueError(f"{where}: only n=1 is supported")
        tools = field(body, "tools", list, None, where) or None
        for i, t in enumerate(tools or []):
            fn = _check_function(t, f"{where}: tools[{i}]")
            params = fn.get("parameters")
            if params is not None and not (isinstance(params, dict) and isinstance(params.get("properties") or {}, dict)
                                           and all(isinstance(v, dict) for v in (params.get("properties") or {}).values())):
                raise ValueError(f"{where}: tools[{i}].function.parameters must be a JSON schema object with "
                                 "object-valued properties")
        tool_choice = body.get("tool_choice", "auto")
        if not isinstance(tool_choice, str):
            raise ValueError(f"{where}: tool_choice must be 'auto', 'none' or 'required'")
        ids = self.encoder.prompt_ids(messages, tools, tool_choice=tool_choice)
        max_tokens = field(body, "max_completion_tokens", int, None, where) or field(body, "max_tokens", int, None, where)
        seed = field(body, "seed", int, None, where)
        if seed is not None and not 0 <= seed < 1 << 63:
            raise ValueError(f"{where}: field 'seed' must be in [0, 2**63), got {seed}")
        sampling = SamplingParams(
            max_new_tokens=max_tokens or self.default_max_tokens,
            temperature=field(body, "temperature", float, 1.0, where),
            top_p=field(body, "top_p", float, 1.0, where), stop_token_ids=tuple(self.encoder.stop_ids), seed=seed,
        )
        return GenerateRequest(ids, sampling, return_logprob=False), tools

    def response(self, req: GenerateRequest, res, tools) -> dict:
        turn = self.encoder.parse_turn(res.output_ids, tools)
        calls, content = [], turn.content
        for c in turn.calls:
            if c.parse_error is None:
                calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}})
            else:  # a call the model botched stays visible as text
                content = (content + "\n" + c.raw).strip()
        finish = "length" if res.finish_reason.type == "length" else ("tool_calls" if calls else "stop")
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if turn.reasoning:
            message["reasoning_content"] = turn.reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(req.input_ids), "completion_tokens": len(res.output_ids),
                      "total_tokens": len(req.input_ids) + len(res.output_ids)},
            "weight_version": res.weight_version,
        }

    async def handle(self, request: web.Request) -> web.Response:
        if self.engine is None:
            raise RuntimeError("ChatEndpoint: no engine attached (build_app attaches the server's engine)")
        try:
            req, tools = self._request(await read_json(request))
            res = await self.engine.generate(req)
        except BadRequest as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=e.status)
        except (ValueError, TypeError, KeyError) as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=400)
        return web.json_response(self.response(req, res, tools))
