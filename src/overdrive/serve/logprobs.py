"""OpenAI's logprobs objects from the engine's `TokenLogprob`s (natural-log probabilities under the model: the
log-softmax of its logits before temperature, top-k and top-p, as vLLM returns them by default).

A completion's (`"logprobs": k`, k from 0 to `MAX_LOGPROBS`)::

    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}] (k each), "text_offset": [int]}

A chat completion's (`"logprobs": true`, `"top_logprobs": k`)::

    {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] (k each)}]}

A token's string is the text it adds after the tokens before it (incremental detokenization, as vLLM's: the
decoding of the last few tokens and it, less theirs), so a SentencePiece token that starts a word keeps its space
and the strings join to the completion's text (special tokens, which the text skips, apart). A token that holds only
part of a multi-byte character reads as "" (no bytes), and the token that completes the character carries all of
it. `text_offset` counts characters of those strings from the start of the completion's text. Two alternatives
whose strings are equal share one key of a completion's `top_logprobs` dict, which keeps the likelier (so it may
hold fewer than k). Every generated token has an entry, a stop token or the tokens of a stop string included
(`usage.completion_tokens` counts them too).
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
        if wants is not None and not isinstance(wants, bool):
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


def completion_logprobs(entries: list[TokenLogprob], tokenizer, context: list[int], offset: int = 0) -> dict:
    """A completion choice's `logprobs` for `entries`; `context`: the token ids before them (the prompt's, and a
    stream's earlier tokens); `offset`: the characters of the text before them (a stream's earlier chunks)."""
    steps = _strings(entries, tokenizer, context)
    tokens = [chosen for chosen, _ in steps]
    tops = []
    for e, (_, alternatives) in zip(entries, steps):
        top: dict[str, float] = {}
        for text, (_, logprob) in zip(alternatives, e.top):  # most likely first: a repeated string keeps the first
            top.setdefault(text, logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []}


def chat_logprobs(entries: list[TokenLogprob], tokenizer, context: list[int]) -> dict:
    """A chat completion choice's `logprobs` for `entries` (`context` as `completion_logprobs`')."""
    def item(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(chosen, e.logprob),
                         "top_logprobs": [item(text, lp) for text, (_, lp) in zip(alternatives, e.top)]}
                        for e, (chosen, alternatives) in zip(entries, _strings(entries, tokenizer, context))]}


WINDOW = 6  # tokens of context decoded before a token: enough for a word's space and a character's bytes


def _strings(entries: list[TokenLogprob], tokenizer, context: list[int]) -> list[tuple[str, list[str]]]:
    """Per entry: its token's string and its alternatives' (each as it would read after the same tokens)."""
    out, before = [], list(context[-WINDOW:])
    for e in entries:
        head = tokenizer.decode(before) if before else ""
        out.append((_after(tokenizer, before, head, e.token_id), [_after(tokenizer, before, head, t) for t, _ in e.top]))
        before = (before + [e.token_id])[-WINDOW:]
    return out


def _after(tokenizer, before: list[int], head: str, token: int) -> str:
    full = tokenizer.decode([*before, token])
    if full.endswith("\ufffd"):  # part of a character: the token that completes it carries the character
        return ""
    head = head.rstrip("\ufffd")  # ... including the bytes the tokens before it held
    return full[len(head):] if full.startswith(head) else tokenizer.decode([token])
