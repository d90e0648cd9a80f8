"""A bounded property-based fuzz of ckpt-serve's whole HTTP API, plus explicit hostile inputs, over real HTTP.

One real ``ckpt-serve`` on the tiny llama model, with the plugin's own routes on (admin, slot files, ``api_key``
namespaces, an operator key), once with one slot and once with ``--parallel 2``. Every operation is fuzzed with
schemathesis (4.x), positive and negative data: the
host's own OpenAPI document (``GET /openapi.json``) plus a fragment for what it does not list (``/checkpoints``,
``/checkpoints/stats``, ``/metrics``, ``/slots/{id}`` and the host's hidden alias
``/v1/engines/copilot-codex/completions``). Every case must get a response below 500, every 4xx a JSON body, and the
server process must still be alive; after each operation a normal chat completion must still answer 200.

Failures are collected rather than raised (no shrinking: the run stays bounded), deduplicated, reported together at
the end with a reproducing request each; a crashed server is restarted so the other routes are still fuzzed. Set
``CKPT_FUZZ_REPORT=<file>`` to also write them as JSON. Bounds: ``CKPT_FUZZ_EXAMPLES`` examples per operation and
generation mode (default 40), a fixed seed per operation (``CKPT_FUZZ_SEED`` varies it), ``max_tokens`` capped at 4.

What schemathesis cannot reach is generated here (:func:`generated_hostile`, seeded likewise): bodies without a
content type, grammars whose language is empty somewhere, grammars and JSON schemas carrying NUL and other control
characters where the grammar needs them, grammars with tens of thousands of alternatives, and chat messages with
``image_url`` parts sent to this text model.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import subprocess
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from support.servers import Server, model_args, run_server  # noqa: E402

OPERATOR = "fuzz-operator-key"
TENANTS = ("fuzz-tenant-a", "fuzz-tenant-b")
MAX_TOKENS = 4
EXAMPLES = int(os.environ.get("CKPT_FUZZ_EXAMPLES", "40"))
SEED = int(os.environ.get("CKPT_FUZZ_SEED", "0"))
REQUEST_TIMEOUT = 60.0
CRASHES_PER_OPERATION = 2  # then the operation is left alone: each restart costs seconds
CLIENT_ERRORS = (400, 405, 413, 415, 422)  # what a hostile request may get
ALIAS = "/v1/engines/copilot-codex/completions"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------------------------------------------------- server


class LiveServer:
    """The module's ckpt-serve; :meth:`ensure` restarts it if a request killed it (each start is counted)."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.server: Server | None = None
        self._context: Any = None
        self.starts = 0

    def ensure(self) -> Server:
        if self.server is not None and self.server.process.poll() is None:
            return self.server
        self.close()
        # no gdb backtrace on an abort: a crashed server exits (and restarts) at once
        self._context = run_server(self.args, env={"GGML_NO_BACKTRACE": "1"})
        self.server = self._context.__enter__()
        self.starts += 1
        return self.server

    def close(self) -> None:
        if self._context is not None:
            context, self._context, self.server = self._context, None, None
            context.__exit__(None, None, None)


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel-1", "parallel-2"])
def live(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory,
         request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    slots = tmp_path_factory.mktemp("fuzz-slots")
    args = model_args(tiny_model("llama")) + [
        "--checkpoint-admin", "true", "--slot-save-path", str(slots), "--checkpoint-namespaces", "api_key",
        "--checkpoint-admin-key", OPERATOR, "--parallel", str(request.param),
    ]
    holder = LiveServer(args)
    holder.ensure()
    try:
        yield holder
    finally:
        holder.close()


def settle(server: Server, timeout: float = 10.0) -> bool:
    """After a request got no response: wait for a dying process to exit; whether it is still alive."""
    try:
        server.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return True
    return False


def normal_chat(server: Server) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", headers=bearer(TENANTS[0]), timeout=REQUEST_TIMEOUT,
                      json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0})


def still_answers(server: Server) -> str | None:
    """``None`` if the process lives and a normal chat completion gets 200, else what went wrong."""
    if server.process.poll() is not None:
        return f"server process exited with {server.process.returncode}"
    try:
        response = normal_chat(server)
    except httpx.HTTPError as exc:
        return f"a normal chat completion got no response: {type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"a normal chat completion got {response.status_code}: {response.text[:300]}"
    return None


_NOISE = re.compile(r"^(#\d+ |\[New LWP|\[Thread |\[Inferior|\d+\t|warning: |Using host libthread|0x[0-9a-f]+ in )")


def log_since(server: Server, start: int) -> str:
    """The server's output since line ``start``, without gdb backtrace noise or successful access-log lines."""
    time.sleep(0.05)  # the reader thread is a little behind the response
    return "\n".join(line.rstrip() for line in server.log[start:]
                     if line.strip() and not _NOISE.match(line) and '" 200 OK' not in line)


def excerpt(log: str, lines: int = 12, width: int = 240) -> str:
    return "\n".join(line[:width] for line in log.splitlines()[-lines:])


def log_excerpt(server: Server, start: int) -> str:
    return excerpt(log_since(server, start))


def json_body(content: bytes) -> bool:
    try:
        json.loads(content)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------- the schema

_BEARER = [{"HTTPBearer": []}]
_JSON_OK = {"200": {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}}


def _plugin_operation(operation_id: str, **extra: Any) -> dict[str, Any]:
    return {"operationId": operation_id, "summary": operation_id, "security": _BEARER, "responses": _JSON_OK, **extra}


PLUGIN_PATHS: dict[str, dict[str, Any]] = {
    "/checkpoints": {
        "get": _plugin_operation("list_checkpoints"),
        "delete": _plugin_operation("clear_checkpoints"),
        "trace": _plugin_operation("trace_checkpoints"),
    },
    "/checkpoints/stats": {
        "get": _plugin_operation("checkpoint_stats"),
        "trace": _plugin_operation("trace_checkpoint_stats"),
    },
    "/metrics": {
        "get": {**_plugin_operation("metrics"),
                "responses": {"200": {"description": "Prometheus text", "content": {"text/plain": {}}}}},
        "trace": _plugin_operation("trace_metrics"),
    },
    "/slots/{id}": {
        "post": _plugin_operation(
            "slot_action",
            parameters=[
                {"name": "id", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0,
                                                                          "maximum": 1}},
                {"name": "action", "in": "query", "required": True,
                 "schema": {"type": "string", "enum": ["save", "restore", "erase"]}},
            ],
            requestBody={"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["filename"],
                "properties": {"filename": {"type": "string", "maxLength": 40}}}}}},
        ),
    },
}


def full_schema(server: Server) -> dict[str, Any]:
    """The host's OpenAPI document plus the routes it does not list."""
    document = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    paths = document["paths"]
    assert "/v1/completions" in paths and "/v1/chat/completions" in paths, sorted(paths)
    alias = copy.deepcopy(paths["/v1/completions"]["post"])
    alias["operationId"] = "copilot_codex_completion_alias"
    paths[ALIAS] = {"post": alias}
    for path, operations in PLUGIN_PATHS.items():
        assert path not in paths, f"the host now lists {path}: drop it from PLUGIN_PATHS"
        paths[path] = copy.deepcopy(operations)
    document.setdefault("components", {}).setdefault("securitySchemes", {})["HTTPBearer"] = {
        "type": "http", "scheme": "bearer"}
    return document


# ------------------------------------------------------------------------------------------------------- the fuzz


@dataclass
class Failure:
    route: str
    problem: str
    request: dict[str, Any]
    curl: str
    log: str

    def size(self) -> int:
        return len(json.dumps(self.request, default=repr))


@dataclass
class Findings:
    failures: dict[tuple[str, str], Failure] = field(default_factory=dict)
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    cases: int = 0

    def add(self, failure: Failure, signature: str) -> None:
        key = (failure.route, signature)
        self.counts[key] = self.counts.get(key, 0) + 1
        known = self.failures.get(key)
        if known is None or failure.size() < known.size():  # keep the smallest reproducer
            self.failures[key] = failure

    def report(self) -> str:
        parts = [f"{len(self.failures)} distinct failures in {self.cases} cases:"]
        for key, failure in sorted(self.failures.items()):
            parts.append(
                f"\n--- {failure.route}: {failure.problem}  (x{self.counts[key]})\n"
                f"request: {json.dumps(failure.request, default=repr, ensure_ascii=True)[:600]}\n"
                f"curl: {failure.curl[:600]}\n"
                + (f"server log:\n{failure.log}\n" if failure.log else "")
            )
        return "".join(parts)


def tame(case: Any) -> None:
    """Keep generation cheap: ``max_tokens`` at most :data:`MAX_TOKENS` (invalid values stay, to be refused)."""
    body = case.body
    if case.method.upper() == "POST" and case.path.endswith("/completions") and isinstance(body, dict):
        value = body.get("max_tokens")
        if value is None or (type(value) is int and value > MAX_TOKENS):
            body["max_tokens"] = MAX_TOKENS


def describe(case: Any) -> dict[str, Any]:
    body = case.body
    return {
        "method": case.method.upper(), "path": case.formatted_path, "query": case.query or None,
        "headers": dict(case.headers or {}) or None, "media_type": case.media_type,
        "body": None if type(body).__name__ == "NotSet" else body,
    }


_DIGITS = re.compile(r"\d+")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Fault))\b", re.M)
_WHAT = re.compile(r"what\(\):\s*([^(\n]*)")


def signature_of(kind: str, content: bytes, log: str) -> str:
    """What makes two failures of one route the same: the kind of problem and the exception (or C++ error) behind
    it, else the error message of the response."""
    what, exceptions = _WHAT.findall(log), _EXCEPTION.findall(log)
    if what:
        detail = f"what(): {what[-1].strip()}"
    elif exceptions:
        detail = exceptions[-1]
    else:
        try:
            error = json.loads(content).get("error", {})
            detail = str(error.get("message", "")) if isinstance(error, dict) else str(error)
        except (ValueError, AttributeError):
            detail = ""
    return f"{kind.split(':')[0]}|{_DIGITS.sub('N', detail)[:80]}"


def fuzz_operation(live: LiveServer, operation: Any, mode: GenerationMode, findings: Findings) -> None:
    state = {"crashes": 0, "n": 0}
    route = f"{operation.method.upper()} {operation.path}"

    # A fixed seed per operation and mode (not derandomize, whose seed is a digest of this function's source): the
    # same cases on every run and every edit of the harness.
    @seed(zlib.crc32(f"{SEED}:{route}:{mode.value}".encode()))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=False,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
              verbosity=Verbosity.quiet)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if state["crashes"] >= CRASHES_PER_OPERATION:
            return
        tame(case)
        server = live.ensure()
        state["n"] += 1
        findings.cases += 1
        generated = {k.lower() for k in (case.headers or {})}
        key = TENANTS[state["n"] % 2] if state["n"] % 3 else OPERATOR  # tenants and the operator, in turn
        extra = {} if "authorization" in generated else bearer(key)
        start = len(server.log)
        content, problem = b"", None
        try:
            response = case.call(base_url=server.url, headers=extra, timeout=REQUEST_TIMEOUT)
        except requests.exceptions.RequestException as exc:
            problem = f"no response: {type(exc).__name__}"
            settle(server)
        else:
            content = response.content
            if response.status_code >= 500:
                problem = f"status {response.status_code}: {content[:200]!r}"
            elif 400 <= response.status_code < 500 and not json_body(content):
                problem = f"{response.status_code} without a JSON body: {content[:120]!r}"
        if server.process.poll() is not None:
            problem = f"server process died (exit {server.process.returncode}); {problem or 'response sent'}"
            state["crashes"] += 1
        if problem is None:
            return
        log = log_since(server, start)
        try:
            curl = case.as_curl_command(headers=extra, base_url=server.url)
        except Exception as exc:  # noqa: BLE001 - a reproducer is a nicety
            curl = f"(no curl: {exc})"
        kind = "crash" if problem.startswith("server process died") else problem
        findings.add(Failure(route, problem, describe(case), curl, excerpt(log)), signature_of(kind, content, log))

    try:
        run()
    except Unsatisfiable:
        pass  # e.g. no negative data exists for an operation without parameters
    if state["crashes"] >= CRASHES_PER_OPERATION:
        findings.add(Failure(route, f"fuzzing stopped after {state['crashes']} crashes ({mode.value})", {}, "", ""),
                     "stopped")
    server = live.ensure()
    problem = still_answers(server)
    if problem is not None:
        findings.add(Failure(route, f"after fuzzing ({mode.value}): {problem}", {}, "", ""), "next request")


def test_fuzz_every_route(live: LiveServer) -> None:
    started = time.monotonic()
    server = live.ensure()
    # no "[Filtered]" in the reproducers (schemathesis hides values of keys like max_tokens and Authorization)
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}})
    schema = schemathesis.openapi.from_dict(full_schema(server), config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    routes = {f"{op.method.upper()} {op.path}" for op in operations}
    for expected in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings",
                     "POST /extras/tokenize", "POST /extras/detokenize", f"POST {ALIAS}", "GET /checkpoints",
                     "DELETE /checkpoints", "GET /checkpoints/stats", "GET /metrics", "POST /slots/{id}"):
        assert expected in routes, (expected, sorted(routes))
    findings = Findings()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz_operation(live, operation, mode, findings)
    # the next request still answers
    server = live.ensure()
    final = normal_chat(server)
    report = findings.report() + f"\n({len(operations)} operations, {live.starts} server starts, " \
                                 f"{time.monotonic() - started:.0f}s)"
    if os.environ.get("CKPT_FUZZ_REPORT"):
        with open(os.environ["CKPT_FUZZ_REPORT"], "w", encoding="utf-8") as out:
            json.dump([{**vars(f), "count": findings.counts[k]} for k, f in sorted(findings.failures.items())], out,
                      indent=1, default=repr)
    assert final.status_code == 200, final.text
    assert not findings.failures, report


# ------------------------------------------------------------------------------------------- explicit hostile input

_COMPLETION = {"prompt": "hi", "max_tokens": 4}
_NESTED = b"[" * 2000 + b"]" * 2000
_JSON = {"Content-Type": "application/json"}


def _json(payload: Any) -> bytes:
    return json.dumps(payload).encode()


# (id, method, path, body bytes, headers)
HOSTILE: list[tuple[str, str, str, bytes | None, dict[str, str]]] = [
    *[(f"bad-grammar{'-alias' if path == ALIAS else ''}", "POST", path,
       _json({**_COMPLETION, "grammar": "root ::= ("}), _JSON) for path in ("/v1/completions", ALIAS)],
    ("json-schema-quote-key", "POST", "/v1/chat/completions", _json({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_object",
                            "schema": {"type": "object", "properties": {'a"b': {"type": "string"}}}}}), _JSON),
    ("detokenize-huge-id", "POST", "/extras/detokenize", _json({"tokens": [999999999]}), _JSON),
    ("detokenize-negative-id", "POST", "/extras/detokenize", _json({"tokens": [-1]}), _JSON),
    *[(f"text-plain{path.replace('/', '-')}", "POST", path, _json(body), {"Content-Type": "text/plain"})
      for path, body in (("/v1/completions", _COMPLETION),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                         ("/extras/tokenize", {"input": "hi"}), ("/slots/0?action=save", {"filename": "x.bin"}))],
    *[(f"lone-surrogate{path.replace('/', '-')}", "POST", path, body, _JSON)
      for path, body in (("/v1/completions", b'{"prompt":"\\ud800"}'),
                         ("/v1/completions", b'{"prompt":"\\ud800","max_tokens":4}'),
                         ("/extras/tokenize", b'{"input":"\\ud800"}'),
                         ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\ud800"}],'
                                                  b'"max_tokens":4}'))],
    ("logit-bias-text-key", "POST", "/v1/completions", _json({**_COMPLETION, "logit_bias": {"abc": 5}}), _JSON),
    ("logit-bias-out-of-vocab", "POST", "/v1/completions",
     _json({**_COMPLETION, "logit_bias": {"999999999": 5}}), _JSON),
    ("chat-logit-bias-text-key", "POST", "/v1/chat/completions", _json({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {"abc": 5}}), _JSON),
    ("chat-logit-bias-out-of-vocab", "POST", "/v1/chat/completions", _json({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {"-7": 5}}), _JSON),
    # a list of prompts (the host asserts there is at most one: found by the fuzz)
    *[(f"prompt-list{'-alias' if path == ALIAS else ''}", "POST", path,
       _json({**_COMPLETION, "prompt": ["a", "b"]}), _JSON) for path in ("/v1/completions", ALIAS)],
    # null where the host's schema allows it, but its sampler takes a float (found by the fuzz)
    *[(f"null-{key}{path.replace('/', '-')}", "POST", path, _json({**body, key: None}), _JSON)
      for key in ("frequency_penalty", "presence_penalty")
      for path, body in (("/v1/completions", _COMPLETION), (ALIAS, _COMPLETION),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))],
    *[(f"{name}{path.replace('/', '-')}", "POST", path, body, _JSON)
      for path, field_name in (("/extras/tokenize", "input"), ("/extras/detokenize", "tokens"),
                               ("/v1/embeddings", "input"))
      for name, body in (("empty", b""),
                         ("nested-2000", b'{"' + field_name.encode() + b'":' + _NESTED + b"}"),
                         ("nested-2000-top", _NESTED),
                         ("non-utf8", b'{"' + field_name.encode() + b'":"\xff\xfe\x80"}'))],
]

# unusual methods: a JSON 405 naming the allowed ones, on the plugin's routes and the host's
METHODS = [(method, path) for path in ("/metrics", "/checkpoints", "/checkpoints/stats", "/slots/0",
                                       "/v1/models", "/v1/completions", ALIAS)
           for method in ("TRACE", "FOO", "CONNECT")]


def check_hostile(live: LiveServer, method: str, path: str, body: bytes | None, headers: dict[str, str],
                  statuses: tuple[int, ...] = CLIENT_ERRORS) -> httpx.Response:
    """Send one request: it must get one of ``statuses`` (a 4xx with a JSON body), the server must live and a normal
    chat completion still answer."""
    server = live.ensure()
    start = len(server.log)
    try:
        response = httpx.request(method, f"{server.url}{path}", content=body,
                                 headers={**bearer(TENANTS[0]), **headers}, timeout=REQUEST_TIMEOUT)
    except httpx.HTTPError as exc:
        alive = settle(server)
        pytest.fail(f"{method} {path}: no response ({type(exc).__name__}: {exc}); "
                    f"process {'alive' if alive else f'died, exit {server.process.returncode}'}\n"
                    f"{log_excerpt(server, start)}")
    context = f"{method} {path} -> {response.status_code} {response.text[:300]!r}\n{log_excerpt(server, start)}"
    assert server.process.poll() is None, f"server died: {context}"
    assert response.status_code < 500, context
    assert response.status_code in statuses, context
    assert response.status_code == 200 or json_body(response.content), f"4xx without a JSON body: {context}"
    problem = still_answers(server)
    assert problem is None, f"{problem}\nafter {context}"
    return response


@pytest.mark.parametrize(("method", "path", "body", "headers"), [case[1:] for case in HOSTILE],
                         ids=[case[0] for case in HOSTILE])
def test_hostile_input(live: LiveServer, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> None:
    check_hostile(live, method, path, body, headers)


@pytest.mark.parametrize(("method", "path"), METHODS, ids=[f"{m}-{p}" for m, p in METHODS])
def test_unusual_method(live: LiveServer, method: str, path: str) -> None:
    response = check_hostile(live, method, path, None, {})
    assert response.status_code == 405 and response.headers.get("allow"), (
        response.status_code, dict(response.headers), response.text[:200])


# ---------------------------------------------------------------------------------- generated hostile generations

_LETTERS = "abcdefghij"
_CONTROLS = [chr(c) for c in (*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 6)))


def _dead_end(rng: random.Random) -> str:
    """A grammar element that matches nothing: an inverted range, or a character no token of the model holds."""
    return rng.choice(["[z-a]", "[b-a]", "[\\x00]", '"\\x00"', "[9-0]"])


def empty_language_grammar(rng: random.Random) -> str:
    """A grammar llama.cpp compiles, every way through which reaches a point that matches nothing within 8
    characters (the grammar check samples paths of 8 tokens)."""

    def short() -> str:
        return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 2)))

    n_rules = rng.randint(1, 3)
    rules = [f"r{i} ::= " + " | ".join(f'"{short()}" r{i + 1}' if i + 1 < n_rules and rng.random() < 0.5
                                         else f'"{short()}" {_dead_end(rng)}' for _ in range(rng.randint(1, 3)))
             for i in range(n_rules)]
    return "root ::= r0\n" + "\n".join(rules)


def control_schema(rng: random.Random) -> dict[str, Any]:
    """A JSON schema with a control character where the grammar needs it (a key, an enum or const value),
    possibly nested."""
    bad = _word(rng) + rng.choice(_CONTROLS) + _word(rng)
    leaf: dict[str, Any] = rng.choice([
        {"type": "object", "properties": {bad: {"type": "string"}}, "required": [bad]},
        {"enum": [_word(rng), bad]},
        {"const": bad},
        {"type": "array", "items": {"enum": [bad]}, "minItems": 1},
    ])
    for _ in range(rng.randint(0, 3)):
        key = _word(rng)
        leaf = {"type": "object", "properties": {key: leaf}, "required": [key]}
    return leaf


def huge_grammar(rng: random.Random) -> str:
    return "root ::= " + " | ".join(f'"{_word(rng)}{_word(rng)}"' for _ in range(rng.randint(20_000, 30_000)))


_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def generated_hostile(count: int = 6) -> list[tuple[str, str, bytes, dict[str, str], tuple[int, ...]]]:
    """``(id, path, body, headers, statuses allowed)``: generated generation requests (seeded by CKPT_FUZZ_SEED)."""
    rng = random.Random(SEED)
    cases: list[tuple[str, str, bytes, dict[str, str], tuple[int, ...]]] = []
    for path, body in (("/v1/completions", _COMPLETION), (ALIAS, _COMPLETION), ("/v1/chat/completions", _CHAT)):
        for name, headers in (("no-content-type", {}), ("empty-content-type", {"Content-Type": ""})):
            cases.append((f"{name}{path.replace('/', '-')}", path, _json(body), headers, (200,)))
    for i in range(count):
        grammar = empty_language_grammar(rng)
        path = rng.choice(["/v1/completions", ALIAS, "/v1/chat/completions"])
        body = _CHAT if path.endswith("chat/completions") else _COMPLETION
        cases.append((f"empty-language-{i}", path, _json({**body, "grammar": grammar}), _JSON, (422,)))
    for i in range(count):
        schema = control_schema(rng)
        where = rng.choice(["response_format", "tool_choice", "tools", "grammar"])
        if where == "response_format":
            extra: dict[str, Any] = {"response_format": {"type": "json_object", "schema": schema}}
        elif where == "grammar":
            extra = {"grammar": f'root ::= "{_word(rng)}{rng.choice(_CONTROLS)}"'}
        else:
            extra = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
            if where == "tool_choice":
                extra["tool_choice"] = {"type": "function", "function": {"name": "f"}}
        cases.append((f"control-character-{where}-{i}", "/v1/chat/completions", _json({**_CHAT, **extra}), _JSON,
                      (422,)))
    for i in range(2):
        # Cheap on this 347-token vocabulary (a few ms a step); refused past grammar_max_step_seconds elsewhere.
        cases.append((f"huge-grammar-{i}", "/v1/completions", _json({**_COMPLETION, "grammar": huge_grammar(rng)}),
                      _JSON, (200, 422)))
    for i, part in enumerate(({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                              {"type": "image_url", "image_url": "http://example.invalid/x.png"},
                              {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                              {"type": "image_url"})):
        content = [{"type": "text", "text": "what is this?"}, part] if i % 2 else [part]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
        cases.append((f"image-url-{i}", "/v1/chat/completions", _json(body), _JSON, (200, *CLIENT_ERRORS)))
    return cases


GENERATED = generated_hostile()


@pytest.mark.parametrize(("path", "body", "headers", "statuses"), [case[1:] for case in GENERATED],
                         ids=[case[0] for case in GENERATED])
def test_generated_hostile_generation(live: LiveServer, path: str, body: bytes, headers: dict[str, str],
                                      statuses: tuple[int, ...]) -> None:
    check_hostile(live, "POST", path, body, headers, statuses)
