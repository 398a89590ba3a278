"""Encoders and a causal LM in one server: `overdrive serve out/pydoc-lm/plan.json out/minilm/plan.json`.

One port, one app: the generator's OpenAI-compatible endpoints (`/v1/...`) and its KServe v2 generate extension
(`/v2/models/<its name>/generate`, `/generate_stream`) go to its `GenerationServer`; every other path (the encoders'
`/v2/models/<name>/infer`, metadata, the repository extension, gRPC when asked) to the encoders' `InferenceServer`.
Health is the two together (ready when both are), `/metrics` the two registries in one exposition (the generator's
families are named apart from the encoders': `overdrive_generation_*`, `overdrive_time_to_first_token_seconds`, ...),
and SIGTERM drains both. The generator's engine thread and the encoders' instance threads share the CPU's cores
(`runner.build_server(share_cores=1)`). One generator per server: a second causal LM is served from a server of its
own (its metrics carry no model label).
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from overdrive.serve.app import InferenceServer
from overdrive.serve.generation import GenerationServer


class CombinedServer:
    """`encoders` and `generator` behind one app (the module docstring); `draining`/`drain()` as `runner.run_server`
    expects.

    Raises:
        ValueError: the generator has an encoder's name."""

    def __init__(self, encoders: InferenceServer, generator: GenerationServer):
        if generator.name in encoders.slots:
            raise ValueError(f"the generator and an encoder are both named {generator.name!r}; give one another name")
        self.encoders, self.generator = encoders, generator
        g, name = generator, generator.name
        self.app = Starlette(routes=[
            Route("/v1/models", g.models, methods=["GET"]),
            Route("/v1/completions", g.completions, methods=["POST"]),
            Route("/v1/chat/completions", g.chat, methods=["POST"]),
            Route(f"/v2/models/{name}/generate", g.kserve_generate, methods=["POST"]),
            Route(f"/v2/models/{name}/generate_stream", g.kserve_generate, methods=["POST"]),
            Route(f"/v2/models/{name}/ready", self.generator_ready, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/health", self.ready, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Mount("/", app=encoders.app),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        async with self.encoders.app.router.lifespan_context(self.encoders.app):  # the encoders' batchers, gRPC
            yield
            if not self.generator.draining:  # stopped without a drain (tests, a second signal)
                await self.generator.drain()

    @property
    def draining(self) -> bool:
        return self.encoders.draining or self.generator.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.encoders.draining = self.generator.draining = value

    async def drain(self) -> None:
        """Both drain at once: readiness false, new requests 503, requests in flight finish (each side's drain
        timeout)."""
        await asyncio.gather(self.encoders.drain(), self.generator.drain())

    @property
    def is_ready(self) -> bool:
        return self.encoders.is_ready and not self.generator.draining

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        return JSONResponse({"ready": self.is_ready}, status_code=200 if self.is_ready else 503)

    async def generator_ready(self, request: Request) -> Response:
        ready = not self.generator.draining
        return JSONResponse({"name": self.generator.name, "ready": ready}, status_code=200 if ready else 503)

    async def prometheus(self, request: Request) -> Response:
        text = generate_latest(self.encoders.metrics.registry) + generate_latest(self.generator.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)
