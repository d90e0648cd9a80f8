"""Small ASGI apps (bare Starlette, FastAPI) over an attached ``Llama``, served by uvicorn in a thread."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ckpt_plugin.testing.ports import free_port
from ckpt_plugin.testing.waiting import wait_until


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30, message="uvicorn did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def completion_endpoint(llama: Any) -> Any:
    async def complete(request: Request) -> JSONResponse:
        body = await request.json()
        result = await run_in_threadpool(
            llama.create_completion, body["prompt"], max_tokens=body.get("max_tokens", 4), temperature=0
        )
        return JSONResponse(result)

    return complete


def starlette_app(llama: Any) -> Starlette:
    return Starlette(routes=[Route("/v1/completions", completion_endpoint(llama), methods=["POST"])])


def fastapi_app(llama: Any) -> FastAPI:
    app = FastAPI()
    app.add_api_route("/v1/completions", completion_endpoint(llama), methods=["POST"])
    return app
