"""Tenants never see each other's state on any route; bad input gets a 4xx JSON error, never a 500; credentials are
checked before bodies are read; every route has a body limit. Real ckpt-serve processes over real HTTP."""

from __future__ import annotations

import hashlib
import shutil
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

from support.servers import model_args, run_server

SYSTEM = "the cat and the dog went to the house " * 12
OPERATOR = "operator-secret"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(server: Any, key: str, user: str = "hello") -> Any:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
    return c.chat.completions.create(model="m", max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


@pytest.fixture(scope="module")
def tenant_server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    slots = tmp_path_factory.mktemp("slots")
    args = model_args(tiny_model("llama")) + [
        "--checkpoint-namespaces", "api_key", "--slot-save-path", str(slots), "--checkpoint-admin", "true",
        "--checkpoint-admin-key", OPERATOR,
    ]
    with run_server(args) as server:
        server.slots = slots
        yield server


def slot(server: Any, action: str, key: str | None, filename: str = "conv.bin") -> httpx.Response:
    headers = bearer(key) if key else {}
    return httpx.post(f"{server.url}/slots/0?action={action}", json={"filename": filename}, headers=headers,
                      timeout=60)


def test_slot_files_are_per_tenant(tenant_server: Any) -> None:
    server = tenant_server
    chat(server, "key-a")
    saved = slot(server, "save", "key-a")
    assert saved.status_code == 200 and saved.json()["n_saved"] > 50
    # B cannot see A's file, nor can a client without a key use slot files at all
    assert slot(server, "restore", "key-b").status_code == 404
    anonymous = slot(server, "restore", None)
    assert anonymous.status_code == 403 and anonymous.json()["error"]["code"] == "forbidden"
    # the slot holds A's state: B has nothing to save there, and B's erase leaves A's state alone
    assert slot(server, "save", "key-b").status_code == 409
    assert httpx.post(f"{server.url}/slots/0?action=erase", headers=bearer("key-b"), timeout=60).json()["n_erased"] == 0
    assert chat(server, "key-a").usage.prompt_tokens_details.cached_tokens > 50
    # B saving the same name writes B's own file, never A's
    chat(server, "key-b")
    assert slot(server, "save", "key-b").status_code == 200
    assert chat(server, "key-c").usage.prompt_tokens_details.cached_tokens == 0
    restored = slot(server, "restore", "key-a")
    assert restored.status_code == 200
    assert chat(server, "key-a").usage.prompt_tokens_details.cached_tokens > 50
    # a file copied into another tenant's directory is refused by the namespace it records
    directories = sorted(p for p in server.slots.iterdir() if p.is_dir())
    assert len(directories) == 2
    files = {d: d / "conv.bin" for d in directories}
    a_file = next(f for f in files.values() if f.exists())
    for directory in directories:
        shutil.copy(a_file, directory / "copied.bin")
    codes = sorted(slot(server, "restore", key, "copied.bin").status_code for key in ("key-a", "key-b"))
    assert codes == [200, 403]


def test_admin_views_are_per_tenant(tenant_server: Any) -> None:
    server = tenant_server
    chat(server, "key-a", "admin a")
    chat(server, "key-b", "admin b")
    views = {}
    for key in ("key-a", "key-b", OPERATOR):
        response = httpx.get(f"{server.url}/checkpoints", headers=bearer(key), timeout=60)
        assert response.status_code == 200
        model = next(iter(response.json()["models"].values()))
        views[key] = {e["namespace"] for e in model["cache"]} | {s["namespace"] for s in model["slots"]}
    assert len(views["key-a"]) == 1 and len(views["key-b"]) == 1 and views["key-a"] != views["key-b"]
    assert views["key-a"] | views["key-b"] <= views[OPERATOR]
    assert httpx.get(f"{server.url}/checkpoints", timeout=60).status_code == 403
    assert httpx.get(f"{server.url}/checkpoints/stats", headers=bearer("key-a"), timeout=60).status_code == 403
    assert httpx.get(f"{server.url}/checkpoints/stats", headers=bearer(OPERATOR), timeout=60).status_code == 200
    # a tenant's DELETE drops only its own entries
    httpx.delete(f"{server.url}/checkpoints", headers=bearer("key-a"), timeout=60)
    after = httpx.get(f"{server.url}/checkpoints", headers=bearer("key-b"), timeout=60).json()
    assert next(iter(after["models"].values()))["cache"] or next(iter(after["models"].values()))["slots"]


@pytest.mark.parametrize("path", ["/slots/%C2%B2", "/slots/00", "/slots/%EF%BC%90", "/slots/-1", "/slots/0x0",
                                  "/slots/", "/slots/0/1"])
def test_odd_slot_ids_are_refused(tenant_server: Any, path: str) -> None:
    response = httpx.post(f"{tenant_server.url}{path}?action=erase", headers=bearer("key-a"), timeout=60)
    assert response.status_code in (400, 404) and "error" in response.json()


def test_slot_file_names_that_are_directories(tenant_server: Any) -> None:
    server = tenant_server
    chat(server, "key-d")
    slot(server, "save", "key-d")  # creates key-d's directory
    directory = server.slots / f"ns-key-{hashlib.sha256(b'key-d').hexdigest()[:16]}"
    assert (directory / "conv.bin").is_file()
    (directory / "a-dir").mkdir()
    for action in ("save", "restore"):
        response = slot(server, action, "key-d", "a-dir")
        assert response.status_code in (400, 404) and "error" in response.json(), action
    for name in ("..", "../x", "/etc/passwd", ".hidden", "a" * 300, ""):
        response = slot(server, "save", "key-d", name)
        assert response.status_code == 400, name


def test_deeply_nested_json_is_a_400(tenant_server: Any) -> None:
    nested = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = httpx.post(f"{tenant_server.url}{path}", content=nested, timeout=60,
                              headers={"content-type": "application/json", **bearer("key-a")})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.post(f"{tenant_server.url}/slots/0?action=save", timeout=60,
                          content=b"[" * 10_000 + b"]" * 10_000, headers=bearer("key-a"))
    assert response.status_code == 400


def test_credentials_before_bodies_and_a_limit_on_every_route(tiny_model: Any) -> None:
    args = model_args(tiny_model("llama")) + ["--api_key", "secret", "--checkpoint-max-body", "1MiB"]
    with run_server(args) as server:
        big = b'{"input": "' + b"x" * (20 << 20) + b'"}'
        started = time.monotonic()
        refused = httpx.post(f"{server.url}/v1/chat/completions", content=big, timeout=60,
                             headers={"content-type": "application/json"})
        assert refused.status_code in (401, 413)
        tokenize = httpx.post(f"{server.url}/extras/tokenize", content=big, timeout=60,
                              headers={"content-type": "application/json", **bearer("secret")})
        assert tokenize.status_code == 413 and tokenize.json()["error"]["code"] == "too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies as the body arrives
            for _ in range(40):
                yield b"x" * 65536

        chunked = httpx.post(f"{server.url}/extras/tokenize", content=chunks(), timeout=60,
                             headers={"content-type": "application/json", **bearer("secret")})
        assert chunked.status_code == 413
        assert time.monotonic() - started < 30
        small = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, timeout=60)
        assert small.status_code == 401 and small.json()["error"]["code"] == "unauthorized"
        ok = httpx.post(f"{server.url}/extras/tokenize", json={"input": "the cat"}, headers=bearer("secret"),
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["tokens"]
