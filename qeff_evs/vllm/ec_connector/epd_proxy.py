"""``qeff-evs epd-proxy``: the front of encoder disaggregation, so a deployment needs no file of vLLM's source tree.

vLLM's encoder-disaggregation recipe puts a proxy in front (``disagg_epd_proxy.py``, in vLLM's examples, not in its
wheel); vllm-router has an encoder mode only in its native binary (``--epd-config``), which the PyPI wheel's
``vllm-router`` command lacks. This proxy does what vLLM's does, for qeff-evs's EC connector: each media item of a
chat request alone (its text removed, ``max_tokens`` 1) to an encoder instance (``ec_producer``; round robin over
several), and once every one answered, the original request, unchanged, to the language side: one ``ec_consumer``
instance, or a vllm-router in front of several (data-parallel replicas with session affinity, or prefill/decode
instances), whose answer (JSON or a stream) is passed back as it comes. Headers such as ``X-Session-ID`` go to the
language side as sent. An encoder that fails answers the client with its status and error; nothing goes on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

MEDIA_PARTS = ("image_url", "video_url", "input_audio", "audio_url")
PASSED_HEADERS = ("x-session-id", "x-user-id", "x-request-id", "authorization", "content-type")


def media_items(body: dict) -> list[dict]:
    """The media parts of a chat request's messages, in order (each goes to an encoder instance alone)."""
    return [part for message in body.get("messages", ()) if isinstance(message.get("content"), list)
            for part in message["content"] if isinstance(part, dict) and part.get("type") in MEDIA_PARTS]


def encoder_request(body: dict, item: dict) -> dict:
    """What an encoder instance is asked for one item: the item alone, one token, the request's own media kwargs."""
    request = {"model": body.get("model"), "messages": [{"role": "user", "content": [item]}], "max_tokens": 1,
               "stream": False}
    if "mm_processor_kwargs" in body:  # a request's own pruning is part of the item's hash: the encoder must see it
        request["mm_processor_kwargs"] = body["mm_processor_kwargs"]
    return request


def make_app(encoders: Sequence[str], language: str, timeout_s: float = 1800.0):
    """The proxy's aiohttp application: ``encoders`` (ec_producer URLs), ``language`` (the consumer side's URL)."""
    from aiohttp import ClientSession, ClientTimeout, web

    turns = itertools.cycle(list(encoders))

    async def start(app):
        app["client"] = ClientSession(timeout=ClientTimeout(total=timeout_s))

    async def stop(app):
        await app["client"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        client = app["client"]
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}

        async def encode(item: dict):
            async with client.post(f"{next(turns)}/v1/chat/completions", json=encoder_request(body, item),
                                   headers=headers) as reply:
                return reply.status, await reply.text()

        if request.path.endswith("/chat/completions"):
            for status, text in await asyncio.gather(*(encode(item) for item in media_items(body))):
                if status != 200:
                    return web.Response(status=status, text=text, content_type="application/json")
        async with client.post(f"{language}{request.path}", json=body, headers=headers) as reply:
            response = web.StreamResponse(status=reply.status, headers={
                "Content-Type": reply.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def passthrough(request: web.Request) -> web.Response:
        async with app["client"].get(f"{language}{request.path}") as reply:
            return web.Response(status=reply.status, body=await reply.read(),
                                content_type=reply.headers.get("Content-Type", "application/json").split(";")[0])

    app = web.Application(client_max_size=1 << 30)  # a request may carry a video as a data URL
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_post("/v1/completions", forward)
    app.router.add_get("/v1/models", passthrough)
    app.router.add_get("/health", passthrough)
    return app


def serve(encoders: Sequence[str], language: str, host: str, port: int) -> None:
    """Run the proxy until interrupted."""
    from aiohttp import web

    if not encoders:
        raise ValueError("epd-proxy needs at least one --encoder URL (an ec_producer instance)")
    web.run_app(make_app(encoders, language.rstrip("/")), host=host, port=port, print=None)
