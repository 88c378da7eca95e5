"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from ..config import ServerArgs
from ..constrained import GRAMMAR_KEYS
from ..messages import GenerateReq, ImageInput
from ..models.source import BUNDLED_NAME, bundled_model_dir
from ..reasoning import ReasoningParser, detect_reasoning, make_reasoning_parser
from ..tool_calls import (
    JsonCallsParser,
    calls_schema,
    calls_structural_tag,
    detect_parser,
    make_parser,
)
from .http import RequestError, json_response, parse_body, sse
from .openai_adapters import ChatAdapter, CompletionAdapter
from .openai_protocol import ChatCompletionRequest, CompletionRequest
from .tokenizer_manager import TokenizerManager

DEFAULT_COMPLETION_TOKENS = 16


def openai_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, setup: "ChatSetup") -> None:
    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served_name(tm, args),
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "radixserve",
                    "root": model_root(args),  # where it was loaded from (vLLM's field)
                    "parent": None,  # a base model's own entry (an adapter names its base)
                    "max_model_len": tm.info.max_context_len,
                }
            ]
            + [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "radixserve",
                    "root": name,
                    "parent": served_name(tm, args),  # vLLM's convention: the adapter's base
                    "max_model_len": tm.info.max_context_len,
                }
                for name in tm.lora_adapters
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        prompts = await _prompt_ids(tm, body.prompt)
        params = body.sampling_params(DEFAULT_COMPLETION_TOKENS)
        reqs = _requests(
            tm,
            prompts,
            params,
            body,
            logprobs=body.logprobs,
            prompt_logprobs=body.echo and body.logprobs is not None,
        )
        echoed = (
            [text for text in _prompt_texts(tm, body.prompt, prompts) for _ in range(body.n)]
            if body.echo
            else None
        )
        adapter = CompletionAdapter(tm, served_name(tm, args), body, echoed)
        if body.stream:
            return sse(adapter.stream(reqs))
        states = await asyncio.gather(*[tm.run_to_end(r, request.is_disconnected) for r in reqs])
        return json_response(adapter.response(states))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        reqs, adapter = await start_chat(tm, setup, body)
        if body.stream:
            return sse(adapter.stream(reqs))
        states = await asyncio.gather(*[tm.run_to_end(r, request.is_disconnected) for r in reqs])
        return json_response(adapter.response(states))


@dataclass(frozen=True)
class ChatSetup:
    """What every chat-shaped route (chat completions, Responses, Anthropic Messages) shares:
    the served name and the tool-call and reasoning parsers the chat template picks."""

    model: str
    tool_parser: str | None
    unparsed_tools: str | None  # why free tool calls are refused (no parser for the template)
    reasoning_parser: ReasoningParser | None

    @classmethod
    def of(cls, tm: TokenizerManager, args: ServerArgs) -> "ChatSetup":
        template = getattr(tm.tokenizer, "chat_template", None)
        tool_parser, unparsed = args.tool_call_parser, None
        if tool_parser is None:
            try:
                tool_parser = detect_parser(template)
            except ValueError as exc:  # constrained calls still work; free ones are refused
                unparsed = str(exc)
        reasoning = make_reasoning_parser(args.reasoning_parser or detect_reasoning(template))
        return cls(served_name(tm, args), tool_parser, unparsed, reasoning)


async def start_chat(
    tm: TokenizerManager, setup: ChatSetup, body: ChatCompletionRequest
) -> tuple[list[GenerateReq], ChatAdapter]:
    """The scheduler requests of a chat body and the adapter that turns their states into
    chat completions: the prompt from the template, tools constrained or parsed."""
    functions = body.offered_functions()
    prompt_ids, images = await chat_prompt_ids(tm, body)
    length_field = "max_tokens"
    if body.max_completion_tokens is not None and body.max_tokens is None:
        body.max_tokens, length_field = body.max_completion_tokens, "max_completion_tokens"
    params = body.sampling_params(default_max_tokens=tm.info.max_context_len)
    forced = body.forced_functions()
    if functions and not forced and setup.tool_parser is None:
        raise RequestError(setup.unparsed_tools)
    parser = (
        (JsonCallsParser() if forced else make_parser(setup.tool_parser)) if functions else None
    )
    if forced:
        if any(key in params for key in GRAMMAR_KEYS):
            raise RequestError(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format, regex or ebnf"
            )
        named = body.tool_choice != "required"  # a named function: exactly one call
        params["json_schema"] = calls_schema(forced, body.parallel_tool_calls and not named)
    elif functions and not any(key in params for key in GRAMMAR_KEYS):
        tag = calls_structural_tag(parser, functions, body.parallel_tool_calls)
        if tag is not None:  # auto: free text, or calls that validate
            params["structural_tag"] = tag
    top = (body.top_logprobs or 0) if body.logprobs else None
    reqs = _requests(
        tm, [prompt_ids], params, body, logprobs=top, length_field=length_field, images=images
    )
    reasoning = setup.reasoning_parser if body.separate_reasoning else None
    return reqs, ChatAdapter(tm, setup.model, body, parser, reasoning)


async def chat_prompt_ids(
    tm: TokenizerManager, body: ChatCompletionRequest
) -> tuple[list[int], list[ImageInput] | None]:
    """The prompt a chat body renders to, through the model's chat template, each image's
    marker expanded to its content-hash tokens; and its images."""
    images = await tm.images.prepare(body.image_parts())
    prompt = await tm.inputs.chat_prompt(
        [m.template_dict(tm.images.markers) for m in body.messages],
        body.template_functions() or None,
        **body.template_options(),
    )
    return tm.images.attach(await tm.inputs.encode(prompt), images)


async def _prompt_ids(tm: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await tm.inputs.encode(prompt)]
    if not prompt:
        raise RequestError("prompt is empty")
    if isinstance(prompt[0], int):
        return [prompt]
    if isinstance(prompt[0], str):
        return [await tm.inputs.encode(p) for p in prompt]
    return list(prompt)


def _prompt_texts(tm: TokenizerManager, prompt: Any, ids: list[list[int]]) -> list[str]:
    """Each prompt as text, for echo: as sent, or decoded when sent as token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [tm.text_of(p) for p in ids]


def _requests(
    tm: TokenizerManager,
    prompts: list[list[int]],
    params: dict,
    body: CompletionRequest | ChatCompletionRequest,
    logprobs: int | None,
    prompt_logprobs: bool = False,
    length_field: str = "max_tokens",
    images: list[ImageInput] | None = None,
) -> list[GenerateReq]:
    """One scheduler request per (prompt, sample). A default output length is capped by the
    context; an explicit one that does not fit is refused, naming `length_field`."""
    explicit = body.max_tokens is not None
    if not explicit:
        room = tm.info.max_context_len - max(len(p) for p in prompts)
        params = dict(params, max_new_tokens=max(min(params["max_new_tokens"], room), 0))
    params = dict(params, n=body.n)
    reqs = []
    for ids in prompts:
        req = tm.make_request(
            ids,
            params,
            return_logprob=logprobs is not None,
            logprob_start_len=0 if prompt_logprobs else -1,
            top_logprobs_num=logprobs or 0,
            priority=body.priority,
            max_tokens_field=length_field if explicit else None,
            cache_salt=body.cache_salt,
            lora_path=body.model if body.model in tm.lora_adapters else None,
            bootstrap=body.bootstrap(),
            images=images,
        )
        reqs += tm.expand_n(req)
    tm.check_disaggregated(reqs)
    return reqs


def model_root(args: ServerArgs) -> str:
    """The served checkpoint's folder (or `dummy:` spec): vLLM's clients load the tokenizer
    from it."""
    spec = args.engine.model
    if spec in (None, "", "default", BUNDLED_NAME):
        return str(bundled_model_dir())
    return spec if spec.startswith("dummy:") else str(Path(spec).expanduser().resolve())


def served_name(tm: TokenizerManager, args: ServerArgs) -> str:
    return args.served_model_name or tm.model_name
