"""CheckpointMiddleware on a bare Starlette app and on a FastAPI app that own attached Llama objects."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import ckpt_plugin
from ckpt_plugin.core.config import ServeSettings
from ckpt_plugin.http.middleware import CheckpointMiddleware

from support.apps import fastapi_app, serve, starlette_app

# Generous: a loaded 2-core machine slows llama.cpp's OpenMP barriers a lot.
HTTP = httpx.Client(timeout=120)
PROMPT = [1, *range(10, 140)]


@pytest.mark.parametrize("make_app", [starlette_app, fastapi_app], ids=["starlette", "fastapi"])
def test_middleware_serves_usage_admin_and_metrics(make_llama: Any, make_app: Any) -> None:
    llama = make_llama("gemma3")
    manager = ckpt_plugin.attach(llama, checkpoint_min_step=32, load_entrypoints=False)
    app = make_app(llama)
    app.add_middleware(CheckpointMiddleware, managers={"tiny": manager}, settings=ServeSettings(admin=True),
                       api_key="k")
    with serve(app) as url:
        auth = {"Authorization": "Bearer k"}
        # the host's key is checked on every POST before its body is read
        refused = HTTP.post(f"{url}/v1/completions", json={"prompt": PROMPT})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        first = HTTP.post(f"{url}/v1/completions", json={"prompt": PROMPT}, headers=auth).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = HTTP.post(f"{url}/v1/completions", json={"prompt": PROMPT + [5, 6]}, headers=auth).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PROMPT) - 1
        assert HTTP.get(f"{url}/checkpoints").status_code == 401
        view = HTTP.get(f"{url}/checkpoints", headers=auth).json()["models"]["tiny"]
        assert view["slots"][0]["checkpoints"] and view["memory_kind"] == "swa"
        stats = HTTP.get(f"{url}/checkpoints/stats", headers=auth).json()["models"]["tiny"]
        assert stats["tokens_reused"] >= len(PROMPT) - 1
        metrics = HTTP.get(f"{url}/metrics", headers=auth).text
        assert 'ckpt_tokens_reused_total{model="tiny"}' in metrics
        assert HTTP.post(f"{url}/v1/completions", content=b"[",
                         headers={"content-type": "application/json", **auth}).status_code == 400
        assert HTTP.get(f"{url}/checkpoints/nothing", headers=auth).status_code == 404


def test_namespace_from_operator_header(make_llama: Any) -> None:
    llama = make_llama("llama")
    manager = ckpt_plugin.attach(llama, load_entrypoints=False)
    app = starlette_app(llama)
    app.add_middleware(CheckpointMiddleware, managers={"tiny": manager},
                       settings=ServeSettings(namespaces="header", namespace_header="x-tenant"))
    with serve(app) as url:
        def cached(tenant: str) -> int:
            response = HTTP.post(f"{url}/v1/completions", json={"prompt": PROMPT}, headers={"x-tenant": tenant})
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("a") == 0
        assert cached("a") > 100
        assert cached("b") == 0
        assert cached("a") > 100
    namespaces = {e["namespace"] for e in manager.describe()["cache"]}
    assert all(ns.startswith("hdr:") and "a" != ns[4:] for ns in namespaces)


def test_header_namespaces_need_a_header_name() -> None:
    with pytest.raises(ValueError, match="namespace_header"):
        ServeSettings(namespaces="header")
