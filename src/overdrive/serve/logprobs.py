"""OpenAI's logprobs objects from the engine's `TokenLogprob`s (natural-log probabilities under the model: the
log-softmax of its logits before temperature, top-k and top-p, as vLLM returns them by default).

A completion's (`"logprobs": k`, k from 0 to `MAX_LOGPROBS`)::

    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}] (k each), "text_offset": [int]}

A chat completion's (`"logprobs": true`, `"top_logprobs": k`)::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] (k each)}]}

A token's string is the tokenizer's decoding of it alone: a token that holds part of a multi-byte character
decodes to U+FFFD, and its `bytes` are that character's. `text_offset` counts characters of those strings from the
start of the completion's text. Every generated token has an entry, a stop token or the tokens of a stop string
included (`usage.completion_tokens` counts them too).
"""

from __future__ import annotations

from itertools import accumulate

from overdrive.generate.engine import MAX_LOGPROBS, TokenLogprob

__all__ = ["MAX_LOGPROBS", "chat_logprobs", "completion_logprobs", "requested"]


def requested(body: dict, *, chat: bool) -> int | None:
    """The k of the request's top logprobs, or None when it asks for none.

    Raises:
        ValueError: (message, the field) a value of the wrong type or range, or a field of the other API."""
    if chat:
        wants, top = body.get("logprobs"), body.get("top_logprobs")
        if wants not in (None, True, False):
            raise ValueError(f"logprobs must be true or false, got {wants!r}", "logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
            raise ValueError(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {top!r}", "top_logprobs")
        if top and not wants:
            raise ValueError("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wants else None
    k = body.get("logprobs")
    if body.get("top_logprobs") is not None:
        raise ValueError("top_logprobs is a chat completion's field; a completion takes logprobs: k", "top_logprobs")
    if k is None:
        return None
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {k!r}", "logprobs")
    return k


def completion_logprobs(entries: list[TokenLogprob], tokenizer, offset: int = 0) -> dict:
    """A completion choice's `logprobs` for `entries`; `offset`: the characters of the text before them (a stream's
    earlier chunks)."""
    tokens = [_string(tokenizer, e.token_id) for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_string(tokenizer, t): lp for t, lp in e.top} for e in entries],
            "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []}


def chat_logprobs(entries: list[TokenLogprob], tokenizer) -> dict:
    """A chat completion choice's `logprobs` for `entries`."""
    def item(token_id: int, logprob: float) -> dict:
        text = _string(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


def _string(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])
