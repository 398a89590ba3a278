"""The OpenAI-compatible request layer of the generation server (`serve/generation.py`): reading a request's JSON
body, its prompt and its sampling fields, the request fields OpenAI's APIs define, errors in OpenAI's shape, and
server-sent events."""

from __future__ import annotations

import json
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from overdrive.generate.engine import Completion, SamplingParams
from overdrive.serve.http_util import BodyCut, read_body
from overdrive.serve.protocol import TooLarge


class Refusal(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None, *, retry: bool = False):
        super().__init__(message)
        self.status, self.kind, self.param, self.retry = status, kind, param, retry

    def response(self) -> Response:
        return error_response(self.status, str(self), self.kind, self.param, retry=self.retry)


class BadRequest(Refusal):
    def __init__(self, message: str, param: str | None):
        super().__init__(400, message, "invalid_request_error", param)


def ended_empty(done: list[Completion], timeout_s: float | None) -> Response | None:
    """The error for a request every choice of which was ended from outside before its first token: 504 at its
    deadline, 503 when the server's drain ran out of time; None when it has something to answer."""
    if not all(c.finish_reason in ("timeout", "abort") and not c.token_ids for c in done):
        return None
    if all(c.finish_reason == "timeout" for c in done):
        return error_response(504, f"the request's deadline ({timeout_s:g} s) passed before its first token", "timeout", "timeout")
    return error_response(503, "the server shut down before the request's first token", "server_error", None, retry=True)


def error_response(status: int, message: str, kind: str, param: str | None, *, retry: bool = False) -> Response:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers={"Retry-After": "1"} if retry else None)


MAX_REQUEST_BYTES = 1 << 22  # 4 MiB: a prompt of a million characters; more is refused (413) as it streams in


async def read_json(request: Request) -> dict:
    """The request's JSON object. Raises Refusal: 413 over `MAX_REQUEST_BYTES`, 400 not a JSON object or a body
    the client cut short."""
    try:
        body = json.loads(await read_body(request, MAX_REQUEST_BYTES))
    except TooLarge as exc:
        raise Refusal(413, str(exc), "invalid_request_error", None) from None
    except BodyCut as exc:
        raise BadRequest(str(exc), None) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}" if not isinstance(exc, RecursionError)
                          else "the body is not JSON this server reads: nested too deep", None) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None)
    return body


def prompt_of(prompt):
    """A completion's prompt: a string, a list of token ids, or a list of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadRequest("prompt must be a non-empty string or list of token ids (one prompt per request here)", "prompt")


# The request fields of OpenAI's completions and chat completions APIs (those that change nothing here, `user`,
# `store`, `metadata`, ..., are taken; those asking for what this server does not do are refused by name), plus
# `top_k` and `timeout` (extensions, as vLLM's `top_k`). Any other field is a 400.
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
                            "stop", "presence_penalty", "frequency_penalty", "logit_bias", "user", "seed", "top_k",
                            "timeout"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of",
                                      "top_logprobs"}  # refused by `requested` with a better message: a chat's field
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                 "parallel_tool_calls", "response_format", "store", "metadata", "service_tier",
                                 "modalities", "reasoning_effort", "prediction", "audio", "functions", "function_call",
                                 "web_search_options", "safety_identifier", "prompt_cache_key", "verbosity"}


def sampling_params(body: dict, *, default_temperature: float, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    """OpenAI's fields as `SamplingParams` (max_tokens default 16, as OpenAI's; ending at `stop_token_ids`, the
    tokenizer's end-of-text). Raises BadRequest."""
    stop = body.get("stop")
    fields = {"max_new_tokens": next((body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None),
                                     16),
              "temperature": body.get("temperature", default_temperature), "top_p": body.get("top_p"),
              "top_k": body.get("top_k"), "seed": body.get("seed"),
              "stop": () if stop is None else stop, "stop_token_ids": stop_token_ids}
    if fields["temperature"] is None:
        fields["temperature"] = default_temperature
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        param = next((k for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop") if k in str(exc)
                      or (k == "max_tokens" and "max_new_tokens" in str(exc))), None)
        raise BadRequest(str(exc).replace("max_new_tokens", "max_tokens"), param) from None


def reseeded(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
