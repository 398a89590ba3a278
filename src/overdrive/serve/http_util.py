"""What both servers (`serve.app`, KServe v2 inference; `serve.generation`, OpenAI-compatible generation) need
from a Starlette request: its body read under a size limit, and the moment its client goes away."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from overdrive.serve.protocol import TooLarge


class BodyCut(Exception):
    """The client went away before its body's end (`received` bytes came)."""

    def __init__(self, received: int):
        super().__init__(f"the client went away after {received} bytes of its body")
        self.received = received


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read as it streams in (also chunked), refused as soon as it passes `limit` bytes.

    Raises:
        TooLarge: over `limit` (the declared Content-Length, or the bytes as they came).
        BodyCut: the client went away before the body's end.
    """
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the body is {declared} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the body is more than {limit} bytes, the most this server takes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise BodyCut(size) from None
    return b"".join(chunks)


async def disconnected(request: Request) -> None:
    """Completes when the client closes its connection (the ASGI `http.disconnect` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
