#!/usr/bin/env python3
"""Checks of `kestrel serve` through the official `openai` Python client.

Run by tests/server_openai.rs against a server on a scripted test model; each check prints
`PASS <name>` or fails with an assertion. Raw HTTP (malformed bodies, metrics, disconnects) goes
through the standard library so that nothing but `openai` needs installing.

    python3 tests/openai/server_checks.py --base-url http://127.0.0.1:PORT/v1 CHECK [CHECK ...]
"""

import argparse
import http.client
import json
import socket
import sys
import threading
import time
import urllib.parse

try:
    import jsonschema
    import openai
except ImportError:
    sys.exit("the `openai` and `jsonschema` packages are missing: python3 -m pip install --target target/test-assets/py "
             "openai jsonschema and put that folder on PYTHONPATH (bash .ci/run does both)")

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


class Context:
    def __init__(self, args):
        self.args = args
        self.base_url = args.base_url
        parsed = urllib.parse.urlparse(args.base_url)
        self.host, self.port = parsed.hostname, parsed.port
        assert self.host in ("127.0.0.1", "localhost", "::1"), "tests only talk to loopback addresses"
        self.client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def raw(self, method, path, body=None, headers=None, timeout=60):
        """One HTTP request; returns (status, headers, body text)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            hdrs = {"Content-Type": "application/json"}
            if self.args.api_key:
                hdrs["Authorization"] = f"Bearer {self.args.api_key}"
            hdrs.update(headers or {})
            conn.request(method, path, body=body, headers=hdrs)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def metrics(self):
        status, _, text = self.raw("GET", "/metrics")
        assert status == 200, f"/metrics answered {status}: {text}"
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values


def assert_error(status, body, want_status, want_param=None, want_code=None):
    assert status == want_status, f"expected HTTP {want_status}, got {status}: {body}"
    error = json.loads(body)["error"]
    for key in ("message", "type", "param", "code"):
        assert key in error, f"error object lacks `{key}`: {error}"
    assert error["message"], "the error message is empty"
    if want_param is not None:
        assert error["param"] == want_param, f"param {error['param']!r} != {want_param!r}: {error}"
    if want_code is not None:
        assert error["code"] == want_code, f"code {error['code']!r} != {want_code!r}: {error}"


def collect_chat_stream(stream):
    """Content, tool calls (by index), finish reason and usage of a streamed chat completion."""
    content, calls, finish, usage, roles = "", {}, None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.role:
                roles.append(delta.role)
            if delta.content:
                content += delta.content
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function and call.function.name:
                    entry["name"] += call.function.name
                if call.function and call.function.arguments:
                    entry["arguments"] += call.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    return content, [calls[i] for i in sorted(calls)], finish, usage, roles


@check
def models(ctx):
    listed = ctx.client.models.list()
    assert [m.id for m in listed.data] == [ctx.model]
    assert ctx.client.models.retrieve(ctx.model).id == ctx.model
    status, _, body = ctx.raw("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok", body


@check
def chat(ctx):
    reply, reply_tokens = ctx.args.expect_reply, ctx.args.expect_reply_tokens
    response = ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "Tell me about kestrels."}], max_tokens=reply_tokens, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == reply, repr(choice.message.content)
    assert choice.finish_reason == "length", choice.finish_reason
    assert response.usage.completion_tokens == reply_tokens, response.usage
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + reply_tokens
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    # Two turns: the history goes through the template, and the answer is the same sentence.
    response = ctx.client.chat.completions.create(
        model=ctx.model, max_tokens=reply_tokens, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": reply}, {"role": "user", "content": [{"type": "text", "text": "Again"}]}])
    assert response.choices[0].message.content == reply
    assert response.usage.prompt_tokens > 20
    # The `spec` extension picks the speculation method per request; it never changes the text.
    for method in ("ngram", "none"):
        response = ctx.client.chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3 * reply_tokens, temperature=0,
            extra_body={"spec": method})
        assert response.choices[0].message.content == reply * 3, (method, response.choices[0].message.content)


@check
def chat_stream(ctx):
    reply, reply_tokens = ctx.args.expect_reply, ctx.args.expect_reply_tokens
    stream = ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "Tell me about kestrels."}], max_tokens=2 * reply_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    content, calls, finish, usage, roles = collect_chat_stream(stream)
    assert roles == ["assistant"], roles
    assert content == reply * 2, repr(content)
    assert calls == [] and finish == "length", (calls, finish)
    assert usage is not None and usage.completion_tokens == 2 * reply_tokens, usage


@check
def stop_strings(ctx):
    reply = ctx.args.expect_reply
    cut = reply.index("waits")
    response = ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "Go"}], max_tokens=50, temperature=0, stop=["waits", "zzz"])
    assert response.choices[0].message.content == reply[:cut], repr(response.choices[0].message.content)
    assert response.choices[0].finish_reason == "stop"
    stream = ctx.client.chat.completions.create(
        model=ctx.model, messages=[{"role": "user", "content": "Go"}], max_tokens=50, temperature=0, stop="dives", stream=True)
    content, _, finish, _, _ = collect_chat_stream(stream)
    assert content == reply[:reply.index("dives")] and finish == "stop", (content, finish)


@check
def completion(ctx):
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    response = ctx.client.completions.create(model=ctx.model, prompt=prompt, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.text, "empty completion"
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12, response.usage
    assert response.object == "text_completion"
    stream = ctx.client.completions.create(model=ctx.model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    streamed, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            streamed += c.text
            finish = c.finish_reason or finish
    assert streamed == choice.text, (streamed, choice.text)
    assert finish == "length"
    # The legacy default is 16 tokens; a prompt of token ids works too.
    response = ctx.client.completions.create(model=ctx.model, prompt=[785, 1962, 267], temperature=0)
    assert response.usage.completion_tokens == 16 and response.usage.prompt_tokens == 3, response.usage


@check
def tool_call(ctx):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather forecast for the coming days",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}}}]
    messages = [{"role": "user", "content": "Weather for the next 3 days?"}]
    response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=tools, temperature=0, max_tokens=64)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.finish_reason
    assert choice.message.content is None, repr(choice.message.content)
    assert len(choice.message.tool_calls) == 1, choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"days": 3}, call.function.arguments
    # The tools are rendered into the prompt by the chat template.
    assert response.usage.prompt_tokens == ctx.args.expect_tool_prompt_tokens, (response.usage, ctx.args.expect_tool_prompt_tokens)

    stream = ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=tools, temperature=0, max_tokens=64, stream=True)
    content, calls, finish, _, _ = collect_chat_stream(stream)
    assert finish == "tool_calls" and content == "", (finish, content)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"days": 3})], calls
    assert calls[0]["id"]

    # The call and its result go back through the template on the next turn.
    followup = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    response = ctx.client.chat.completions.create(model=ctx.model, messages=followup, tools=tools, temperature=0, max_tokens=64)
    assert response.choices[0].finish_reason == "tool_calls"
    assert response.usage.prompt_tokens > ctx.args.expect_tool_prompt_tokens

    # Without tools (or with tool_choice none) the same text is plain content.
    for extra in ({}, {"tools": tools, "tool_choice": "none"}):
        response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=0, max_tokens=64, **extra)
        choice = response.choices[0]
        assert choice.message.tool_calls in (None, []), choice.message.tool_calls
        assert choice.message.content == ctx.args.expect_tool_text, repr(choice.message.content)
        assert choice.finish_reason == "stop"


@check
def errors(ctx):
    chat_path = "/v1/chat/completions"
    good = {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    status, _, body = ctx.raw("POST", chat_path, body="{\"model\": ")
    assert_error(status, body, 400)
    status, _, body = ctx.raw("POST", chat_path, body="[1, 2]")
    assert_error(status, body, 400)
    # A value of the wrong type names its field, as OpenAI's errors do.
    for field, value in (("temperature", "hot"), ("max_tokens", "many"), ("stream", "yes"), ("stop", 5)):
        status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, field: value}))
        assert_error(status, body, 400, want_param=field)
    status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, "messages": [{"role": "user", "content": 5}]}))
    assert_error(status, body, 400, want_param="messages[0].content")

    try:
        ctx.client.chat.completions.create(model="no-such-model", messages=good["messages"], max_tokens=4)
        raise AssertionError("an unknown model was accepted")
    except openai.BadRequestError as err:
        assert err.status_code == 400 and err.code == "model_not_found", (err.status_code, err.code)

    long_prompt = "kestrel " * 5000
    try:
        ctx.client.completions.create(model=ctx.model, prompt=long_prompt, max_tokens=4)
        raise AssertionError("a prompt longer than the context was accepted")
    except openai.BadRequestError as err:
        assert err.code == "context_length_exceeded", err.code
    try:
        ctx.client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
        raise AssertionError("a conversation longer than the context was accepted")
    except openai.BadRequestError as err:
        assert err.code == "context_length_exceeded", err.code

    status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, "max_tokens": 100000}))
    assert_error(status, body, 400, want_param="max_tokens", want_code="context_length_exceeded")

    for field, value in (("temperature", 5.0), ("temperature", -1), ("top_p", 0.0), ("max_tokens", 0), ("n", 0), ("top_k", -3),
                         ("min_p", 1.5), ("presence_penalty", 5.0), ("spec", "telepathy")):
        status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, field: value}))
        assert_error(status, body, 400, want_param=field)
    status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, "messages": [{"role": "wizard", "content": "x"}]}))
    assert_error(status, body, 400, want_param="messages[0]")
    status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, "messages": []}))
    assert_error(status, body, 400, want_param="messages")
    # A message needs content (only an assistant turn calling tools may go without).
    for message in ({"role": "user"}, {"role": "user", "content": None}):
        status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, "messages": [message]}))
        assert_error(status, body, 400, want_param="messages[0].content")
    # Malformed tools and tool_choice are refused, not taken as no tools.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    for extra, param in (({"tools": [{"type": "function"}]}, "tools[0].function"),
                         ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
                         ({"tools": [tool], "tool_choice": "sometimes"}, "tool_choice"),
                         ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
                         ({"tools": "get_weather"}, "tools")):
        status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, **extra}))
        assert_error(status, body, 400, want_param=param)
    # "stream": null is false: a whole response.
    status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, "stream": None}))
    assert status == 200 and json.loads(body)["object"] == "chat.completion", (status, body)
    # A route that exists answers another method with a JSON 405.
    for method, path in (("GET", chat_path), ("DELETE", "/v1/completions"), ("POST", "/v1/models")):
        status, _, body = ctx.raw(method, path)
        assert_error(status, body, 405, want_code="method_not_allowed")
    # Without --allowed-origins, no CORS headers.
    _, headers, _ = ctx.raw("GET", "/v1/models", headers={"Origin": "http://example.com"})
    assert not any(h.lower() == "access-control-allow-origin" for h in headers), headers
    status, _, body = ctx.raw("POST", "/v1/completions", body=json.dumps({"model": ctx.model, "prompt": ["a", "b"]}))
    assert_error(status, body, 400, want_param="prompt")
    status, _, body = ctx.raw("POST", "/v1/completions", body=json.dumps({"model": ctx.model, "prompt": [999999999]}))
    assert_error(status, body, 400, want_param="prompt")

    status, _, body = ctx.raw("GET", "/v1/nothing-here")
    assert_error(status, body, 404)

    big = json.dumps({**good, "messages": [{"role": "user", "content": "x" * (ctx.args.body_limit + 10)}]})
    status, _, body = ctx.raw("POST", chat_path, body=big)
    assert_error(status, body, 413)

    # After all of that the server still answers.
    response = ctx.client.chat.completions.create(model=ctx.model, messages=good["messages"], max_tokens=4, temperature=0)
    assert response.choices[0].message.content
    status, _, body = ctx.raw("GET", "/health")
    assert status == 200, body


@check
def api_key(ctx):
    key = ctx.args.api_key
    assert key, "run this check against a server started with --api-key"
    anonymous = openai.OpenAI(base_url=ctx.base_url, api_key="wrong-key", max_retries=0, timeout=60)
    try:
        anonymous.models.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError as err:
        assert err.status_code == 401
    status, _, body = ctx.raw("POST", "/v1/chat/completions", body="{}", headers={"Authorization": ""})
    assert_error(status, body, 401, want_code="invalid_api_key")
    status, _, body = ctx.raw("GET", "/metrics", headers={"Authorization": "Bearer nope"})
    assert_error(status, body, 401)
    # The health check needs no key; the right key works.
    status, _, _ = ctx.raw("GET", "/health", headers={"Authorization": ""})
    assert status == 200
    response = ctx.client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0)
    assert response.choices[0].message.content


def header(headers, name):
    return next((v for k, v in headers.items() if k.lower() == name), None)


@check
def cors(ctx):
    allowed = ctx.args.allowed_origin
    assert allowed, "run this check against a server started with --allowed-origins"
    # A browser's preflight is answered, without the API key, for the allowed origin.
    status, headers, _ = ctx.raw("OPTIONS", "/v1/chat/completions", headers={
        "Origin": allowed, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang", "Authorization": ""})
    assert status == 200, (status, headers)
    assert header(headers, "access-control-allow-origin") == allowed, headers
    assert "POST" in header(headers, "access-control-allow-methods"), headers
    assert "authorization" in header(headers, "access-control-allow-headers").lower(), headers
    _, headers, body = ctx.raw("GET", "/v1/models", headers={"Origin": allowed})
    assert header(headers, "access-control-allow-origin") == allowed, headers
    assert json.loads(body)["data"], body
    # Another origin gets no grant.
    _, headers, _ = ctx.raw("GET", "/v1/models", headers={"Origin": "http://elsewhere.example"})
    assert header(headers, "access-control-allow-origin") is None, headers


@check
def nonfinite(ctx):
    reply = ctx.args.expect_reply
    before = ctx.metrics()
    good = {}

    def long_reply():
        stream = ctx.client.chat.completions.create(
            model=ctx.model, messages=[{"role": "user", "content": "Tell me about kestrels."}], max_tokens=1500,
            temperature=0, stream=True, stream_options={"include_usage": True})
        good["content"], _, good["finish"], good["usage"], _ = collect_chat_stream(stream)

    thread = threading.Thread(target=long_reply)
    thread.start()
    deadline = time.time() + 60
    while ctx.metrics()["kestrel_requests_running"] < 1:
        assert time.time() < deadline, "the long request never started"
        time.sleep(0.02)
    poisoned = [{"role": "user", "content": f"A word about {ctx.args.poison_word}."}]
    # Whole: a 500 for this request only.
    try:
        ctx.client.chat.completions.create(model=ctx.model, messages=poisoned, max_tokens=8, temperature=0)
        raise AssertionError("a request whose logits are NaN succeeded")
    except openai.InternalServerError as err:
        assert err.status_code == 500 and err.code == "generation_failed", (err.status_code, err.code)
        assert "finite" in err.message, err.message
    # Streamed: an error event ends the stream.
    try:
        for _ in ctx.client.chat.completions.create(model=ctx.model, messages=poisoned, max_tokens=8, temperature=0, stream=True):
            pass
        raise AssertionError("a streamed request whose logits are NaN ended normally")
    except openai.APIError as err:
        assert "finite" in str(err), err
    assert ctx.metrics()["kestrel_requests_running"] >= 1, "the long request should still be running"
    thread.join(timeout=240)
    assert not thread.is_alive(), "the long request did not finish"
    assert good["finish"] == "length" and good["usage"].completion_tokens == 1500, good
    assert good["content"].startswith(reply * 20), good["content"][:200]
    after = ctx.metrics()
    assert after["kestrel_requests_failed_total"] == before["kestrel_requests_failed_total"] + 2, after
    status, _, body = ctx.raw("GET", "/health")
    assert status == 200, body


def concurrent_requests():
    """Eight different requests: four greedy, four seeded samples, chat and completion."""
    requests = []
    for i in range(8):
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
        if i % 4 < 2:
            requests.append(("completion", {"prompt": f"# task {i}: sort a list of {i + 3} numbers\ndef solve(xs):", "max_tokens": 24 + i, **sampling}))
        else:
            requests.append(("completion", {"prompt": [1000 + 37 * i, 2000 + 11 * i, 3000 + i], "max_tokens": 20 + 2 * i, **sampling}))
    return requests


def run_streamed(ctx, request):
    _, params = request
    stream = ctx.client.completions.create(model=ctx.model, stream=True, **params)
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


@check
def concurrency(ctx):
    requests = concurrent_requests()
    alone = [run_streamed(ctx, r) for r in requests]
    assert len(set(alone)) == len(alone), "the eight requests should give eight different outputs"

    results = [None] * len(requests)
    errors = []
    peak_running = [0]
    done = threading.Event()

    def worker(i):
        try:
            results[i] = run_streamed(ctx, requests[i])
        except Exception as err:  # reported below, with the request it came from
            errors.append((i, repr(err)))

    def watch_batch():
        while not done.is_set():
            peak_running[0] = max(peak_running[0], ctx.metrics().get("kestrel_requests_running", 0))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_batch)
    watcher.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    done.set()
    watcher.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a concurrent stream did not finish"
    assert not errors, errors
    for i, (together, by_itself) in enumerate(zip(results, alone)):
        assert together == by_itself, f"request {i} differs when batched:\n{together!r}\n{by_itself!r}"
    assert peak_running[0] >= 2, f"the requests never shared a batch (peak running {peak_running[0]})"


def open_chat_request(ctx, stream):
    """Sends a long chat request on a raw socket and returns the socket."""
    body = json.dumps({"model": ctx.model, "messages": [{"role": "user", "content": "Talk forever."}],
                       "max_tokens": 3000, "temperature": 0, "stream": stream})
    sock = socket.create_connection((ctx.host, ctx.port), timeout=60)
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {ctx.host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body.encode())}\r\n")
    if ctx.args.api_key:
        request += f"Authorization: Bearer {ctx.args.api_key}\r\n"
    sock.sendall((request + "\r\n" + body).encode())
    return sock


def wait_until_idle(ctx, what):
    deadline = time.time() + 30
    while True:
        metrics = ctx.metrics()
        if metrics["kestrel_requests_running"] == 0 and metrics["kestrel_requests_waiting"] == 0:
            return metrics
        assert time.time() < deadline, f"{what}: the request kept running after the client left: {metrics}"
        time.sleep(0.05)


@check
def disconnect(ctx):
    before = ctx.metrics()
    sock = open_chat_request(ctx, stream=True)
    received = b""
    deadline = time.time() + 60
    while received.count(b"data: ") < 5 and time.time() < deadline:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the stream early"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    assert received.count(b"data: ") >= 5, "no tokens streamed"
    running = ctx.metrics()["kestrel_requests_running"]
    assert running == 1, f"expected the stream to be running, metrics say {running}"
    sock.close()

    metrics = wait_until_idle(ctx, "streaming")
    assert metrics["kestrel_requests_cancelled_total"] == before["kestrel_requests_cancelled_total"] + 1, metrics
    assert metrics["kestrel_kv_blocks_used"] == 0 and metrics["kestrel_state_slots_used"] == 0, metrics
    generated = metrics["kestrel_generated_tokens_total"] - before["kestrel_generated_tokens_total"]
    assert generated < 3000, f"{generated} tokens were generated: the request was not cancelled"
    time.sleep(0.3)
    assert ctx.metrics()["kestrel_generated_tokens_total"] == metrics["kestrel_generated_tokens_total"], "generation went on"

    # A client waiting for a whole (non-streamed) response that gives up cancels it as well.
    before = metrics
    sock = open_chat_request(ctx, stream=False)
    deadline = time.time() + 30
    while ctx.metrics()["kestrel_generated_tokens_total"] < before["kestrel_generated_tokens_total"] + 10:
        assert time.time() < deadline, "the non-streamed request did not start"
        time.sleep(0.05)
    sock.close()
    metrics = wait_until_idle(ctx, "not streaming")
    assert metrics["kestrel_requests_cancelled_total"] == before["kestrel_requests_cancelled_total"] + 1, metrics
    assert metrics["kestrel_kv_blocks_used"] == 0, metrics


# --- Generation features: structured outputs, forced tool calls, log probabilities, choices,
# penalties, reasoning. Each compares the speculation methods: tokens and log probabilities must
# be bitwise the same with spec none, ngram and mtp.

SPECS = ("none", "ngram", "mtp")

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"], "additionalProperties": False}}},
]


def chat_choices(response):
    """What a chat response says, without its random ids: per choice the message, tool calls,
    log probabilities and finish reason."""
    out = []
    for choice in response.choices:
        message = choice.message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        logprobs = choice.logprobs.model_dump() if choice.logprobs else None
        out.append((choice.index, message.content, getattr(message, "reasoning_content", None), calls, logprobs, choice.finish_reason))
    return out


def completion_choices(response):
    return [(c.index, c.text, c.logprobs.model_dump() if c.logprobs else None, c.finish_reason) for c in response.choices]


def across_specs(run):
    """`run(spec)` for every speculation method; all must give the same answer, which is returned."""
    answers = {spec: run(spec) for spec in SPECS}
    for spec in SPECS[1:]:
        assert answers[spec] == answers["none"], f"spec {spec} changed the output:\n{answers[spec]}\nnone:\n{answers['none']}"
    return answers["none"]


@check
def json_schema(ctx):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in range(20):
        def run(spec):
            response = ctx.client.chat.completions.create(
                model=ctx.model, messages=messages, response_format=response_format, temperature=1.0, seed=seed, max_tokens=400,
                logprobs=True, top_logprobs=2, extra_body={"spec": spec})
            return chat_choices(response)
        [(_, content, _, _, logprobs, finish)] = across_specs(run) if seed < 3 else run("none")
        assert finish == "stop", (seed, finish, content)
        value = json.loads(content)
        jsonschema.validate(value, PERSON_SCHEMA)
        assert len(logprobs["content"]) > 0
    # The same through a stream, and a plain JSON object.
    stream = ctx.client.chat.completions.create(model=ctx.model, messages=messages, response_format=response_format, temperature=1.0, seed=3,
                                                max_tokens=400, stream=True)
    content, _, finish, _, _ = collect_chat_stream(stream)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), PERSON_SCHEMA)
    response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=24)
    assert response.choices[0].message.content.startswith("{"), response.choices[0].message.content


@check
def grammar(ctx):
    lark = 'start: answer "."\nanswer: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    seen = set()
    for seed in range(6):
        def run(spec):
            response = ctx.client.completions.create(model=ctx.model, prompt="Is it raining?", temperature=1.0, seed=seed, max_tokens=16,
                                                     extra_body={"grammar": lark, "spec": spec})
            return completion_choices(response)
        [(_, text, _, finish)] = across_specs(run)
        assert finish == "stop", (text, finish)
        assert text in ("yes.", "no.") or (text.startswith("maybe ") and text[6:-1].isdigit() and text.endswith(".")), text
        seen.add(text)
    response = ctx.client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=16,
                                                  extra_body={"grammar": lark})
    assert response.choices[0].message.content in ("yes.", "no.") or response.choices[0].message.content.startswith("maybe "), response.choices[0].message.content


def tool_by_name(name):
    return next(t["function"] for t in WEATHER_TOOLS if t["function"]["name"] == name)


@check
def forced_tool_calls(ctx):
    messages = [{"role": "user", "content": "What should I wear tomorrow?"}]
    for choice, seeds in (("required", range(4)), ({"type": "function", "function": {"name": "get_time"}}, range(2))):
        for seed in seeds:
            def run(spec):
                response = ctx.client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=WEATHER_TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=200,
                    logprobs=True, extra_body={"spec": spec})
                return chat_choices(response)
            [(_, content, _, calls, _, finish)] = across_specs(run)
            assert finish == "tool_calls", (finish, content, calls)
            assert len(calls) == 1, calls
            name, arguments = calls[0]
            if isinstance(choice, dict):
                assert name == "get_time", name
            jsonschema.validate(json.loads(arguments), tool_by_name(name)["parameters"])
    stream = ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=WEATHER_TOOLS, tool_choice="required", temperature=1.0,
                                                seed=1, max_tokens=200, stream=True)
    _, calls, finish, _, _ = collect_chat_stream(stream)
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool_by_name(calls[0]["name"])["parameters"])


@check
def forced_xml_tool_call(ctx):
    """On the Qwen3.5-template model the forced call is XML; it reasons first, freely."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"]}}}]
    messages = [{"role": "user", "content": "Weather in San Francisco?"}]

    def run(spec):
        response = ctx.client.chat.completions.create(
            model=ctx.model, messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0, max_tokens=200, logprobs=True, extra_body={"spec": spec})
        return chat_choices(response)
    [(_, content, reasoning, calls, _, finish)] = across_specs(run)
    assert reasoning == ctx.args.expect_reasoning, reasoning
    assert finish == "tool_calls" and content is None, (finish, content)
    assert len(calls) == 1 and calls[0][0] == "get_weather", calls
    jsonschema.validate(json.loads(calls[0][1]), tools[0]["function"]["parameters"])


@check
def logprobs(ctx):
    prompt = [1000, 2000, 3000, 4000]
    def run(spec):
        response = ctx.client.completions.create(model=ctx.model, prompt=prompt, temperature=1.0, seed=11, max_tokens=16, logprobs=5,
                                                 extra_body={"spec": spec, "return_tokens_as_token_ids": True})
        return completion_choices(response)
    [(_, text, logprobs, _)] = across_specs(run)
    assert len(logprobs["tokens"]) == 16 and all(t.startswith("token_id:") for t in logprobs["tokens"]), logprobs["tokens"]
    tokens = [int(t.split(":")[1]) for t in logprobs["tokens"]]
    tops = [{int(k.split(":")[1]): v for k, v in top.items()} for top in logprobs["top_logprobs"]]
    for top in tops:
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True), top
    # Rust recomputes the logits of these positions and compares.
    print("LOGPROBS_JSON " + json.dumps({"prompt": prompt, "tokens": tokens, "token_logprobs": logprobs["token_logprobs"],
                                          "top_logprobs": [list(t.items()) for t in tops]}), flush=True)
    # The same tokens streamed, and as text.
    stream = ctx.client.completions.create(model=ctx.model, prompt=prompt, temperature=1.0, seed=11, max_tokens=16, logprobs=5, stream=True)
    streamed_text, streamed_logprobs = "", []
    for chunk in stream:
        for c in chunk.choices:
            streamed_text += c.text
            if c.logprobs:
                streamed_logprobs += c.logprobs.token_logprobs
    assert streamed_text == text and streamed_logprobs == logprobs["token_logprobs"], (streamed_text, text)
    # Chat: entries with bytes and alternatives, streamed the same as whole.
    messages = [{"role": "user", "content": "Tell me about kestrels."}]
    def run_chat(spec):
        return chat_choices(ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=0.7, seed=2, max_tokens=20,
                                                               logprobs=True, top_logprobs=3, extra_body={"spec": spec}))
    [(_, content, _, _, chat_logprobs, _)] = across_specs(run_chat)
    entries = chat_logprobs["content"]
    assert len(entries) == 20 and bytes(b for e in entries for b in e["bytes"]).decode() == content, content
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in entries)
    stream = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=0.7, seed=2, max_tokens=20, logprobs=True,
                                                top_logprobs=3, stream=True)
    streamed = [e.model_dump() for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content or []]
    assert streamed == entries


@check
def choices(ctx):
    prompt = [1000, 2000, 3000]
    def run(spec, n):
        return completion_choices(ctx.client.completions.create(model=ctx.model, prompt=prompt, temperature=1.0, seed=21, max_tokens=16, n=n,
                                                                logprobs=1, extra_body={"spec": spec}))
    four = across_specs(lambda spec: run(spec, 4))
    one = across_specs(lambda spec: run(spec, 1))
    assert [c[0] for c in four] == [0, 1, 2, 3]
    assert four[0][1:] == one[0][1:], (four[0], one[0])
    assert len({c[1] for c in four}) > 1, "four choices with their own seeds should not all agree"
    # Chat, streamed: each choice's deltas carry its index; together they equal the whole answer.
    messages = [{"role": "user", "content": "Hi"}]
    whole = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=1.0, seed=4, max_tokens=12, n=3)
    stream = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=1.0, seed=4, max_tokens=12, n=3, stream=True,
                                                stream_options={"include_usage": True})
    texts, finishes, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}, (texts, whole.choices)
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 36 == whole.usage.completion_tokens, usage


# Twelve tokens lifted far above the rest by logit_bias: the output is drawn among them, so
# it repeats itself, and penalties (which act after the bias) decide how much.
CANDIDATES = {str(token): 100 for token in range(5000, 5012)}


def generated_ids(ctx, spec="none", temperature=1.0, logit_bias=None, **sampling):
    response = ctx.client.completions.create(
        model=ctx.model, prompt=[1000, 2000, 3000], temperature=temperature, seed=1, max_tokens=48, logprobs=0,
        extra_body={"spec": spec, "return_tokens_as_token_ids": True, "logit_bias": CANDIDATES if logit_bias is None else logit_bias, **sampling})
    return [int(t.split(":")[1]) for t in response.choices[0].logprobs.tokens]


def repeats(ids):
    return len(ids) - len(set(ids))


@check
def penalties(ctx):
    plain = generated_ids(ctx)
    assert set(plain) <= {int(t) for t in CANDIDATES}, plain
    # Positive presence and frequency penalties repeat less, negative ones more.
    for field in ("presence_penalty", "frequency_penalty"):
        discouraged = across_specs(lambda spec: generated_ids(ctx, spec, **{field: 2.0}))
        encouraged = across_specs(lambda spec: generated_ids(ctx, spec, **{field: -2.0}))
        assert repeats(discouraged) < repeats(plain) < repeats(encouraged), (field, repeats(discouraged), repeats(plain), repeats(encouraged))
    discouraged = across_specs(lambda spec: generated_ids(ctx, spec, repetition_penalty=1.3))
    assert repeats(discouraged) < repeats(plain), (repeats(discouraged), repeats(plain))
    assert generated_ids(ctx, repeat_penalty=1.3) == discouraged, "repeat_penalty is repetition_penalty's other name"
    # Greedy, the frequency penalty spreads the output over every candidate.
    assert len(set(generated_ids(ctx, temperature=0, frequency_penalty=2.0))) == len(CANDIDATES)
    # logit_bias: -100 bans a token, +100 all but forces it.
    free = generated_ids(ctx, temperature=0, logit_bias={})
    assert free[0] not in generated_ids(ctx, temperature=0, logit_bias={str(free[0]): -100})
    assert generated_ids(ctx, temperature=0, logit_bias={"42": 100})[:3] == [42, 42, 42]
    # A bias that makes the end of the turn certain ends it at once, unless ignore_eos.
    end = {"151645": 100}
    response = ctx.client.completions.create(model=ctx.model, prompt="x", temperature=0, max_tokens=10, logit_bias=end)
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == 0, response
    response = ctx.client.completions.create(model=ctx.model, prompt="x", temperature=0, max_tokens=10, logit_bias=end, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 10, response


@check
def reasoning(ctx):
    """A thinking model on the Qwen3 template: reasoning apart from the answer, whole and streamed."""
    reasoning_text, answer = ctx.args.expect_reasoning, ctx.args.expect_answer
    messages = [{"role": "user", "content": "What is the weather?"}]
    for tools, want_content, want_calls, want_finish in (
            (None, answer, [], "stop"),
            (WEATHER_TOOLS, answer[:answer.index("\n<tool_call>")], [("get_weather", {"days": 3})], "tool_calls")):
        extra = {"tools": tools} if tools else {}
        response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=0, max_tokens=200, **extra)
        message = response.choices[0].message
        assert message.reasoning_content == reasoning_text, repr(message.reasoning_content)
        assert message.content == want_content, repr(message.content)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == want_calls, message.tool_calls
        assert response.choices[0].finish_reason == want_finish
        stream = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=0, max_tokens=200, stream=True, **extra)
        streamed_reasoning, content, calls, finish = "", "", [], None
        for chunk in stream:
            for c in chunk.choices:
                streamed_reasoning += getattr(c.delta, "reasoning_content", None) or ""
                content += c.delta.content or ""
                calls += [(t.function.name, json.loads(t.function.arguments)) for t in c.delta.tool_calls or []]
                finish = c.finish_reason or finish
        assert (streamed_reasoning, content, calls, finish) == (reasoning_text, want_content, want_calls, want_finish)
    # A stop string ends the answer; the reasoning before it stays.
    response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=0, max_tokens=200, stop=["<tool_call>"])
    assert response.choices[0].message.content == answer[:answer.index("<tool_call>")]
    assert response.choices[0].message.reasoning_content == reasoning_text
    # Thinking off: the template writes an empty block, and the model answers at once.
    response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, temperature=0, max_tokens=200,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.choices[0].message.content == ctx.args.expect_off_answer, response.choices[0].message
    assert getattr(response.choices[0].message, "reasoning_content", None) is None
    assert response.usage.prompt_tokens == ctx.args.expect_off_prompt_tokens, response.usage
    # An earlier turn's reasoning goes back to the template, which drops it (this template keeps
    # only the reasoning after the last user message).
    history = messages + [{"role": "assistant", "content": answer, "reasoning_content": reasoning_text}, {"role": "user", "content": "And tomorrow?"}]
    response = ctx.client.chat.completions.create(model=ctx.model, messages=history, temperature=0, max_tokens=200)
    assert response.choices[0].message.reasoning_content == reasoning_text


@check
def xml_tool_calls(ctx):
    """The Qwen3.5 template: reasoning opened by the prompt, then XML tool calls with typed arguments."""
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "filters": {"type": "object"}, "note": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": ["string", "null"]}}}}},
    ]
    # Python's None inside the object is null; the multi-line string keeps its inner newline.
    want = [("get_weather", {"city": "San Francisco", "days": 3, "filters": {"rain": {"min": 0.5}, "hours": [6, 18], "alerts": True, "station": None},
                             "note": "first line\nsecond line"})]
    messages = [{"role": "user", "content": "Weather in San Francisco?"}]
    response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=tools, temperature=0, max_tokens=300)
    message = response.choices[0].message
    assert message.reasoning_content == ctx.args.expect_reasoning, repr(message.reasoning_content)
    assert message.content is None, repr(message.content)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == want, message.tool_calls
    assert response.choices[0].finish_reason == "tool_calls"
    stream = ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=tools, temperature=0, max_tokens=300, stream=True)
    content, calls, finish, _, _ = collect_chat_stream(stream)
    assert content == "" and finish == "tool_calls", (content, finish)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want, calls
    # The calls go back through the template as the model wrote them, typed values and all.
    followup = messages + [
        {"role": "assistant", "content": None, "reasoning_content": message.reasoning_content,
         "tool_calls": [c.model_dump() for c in message.tool_calls]},
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
    ]
    status, _, body = ctx.raw("POST", "/tokenize", body=json.dumps({"model": ctx.model, "messages": followup, "tools": tools}))
    assert status == 200, body
    status, _, text = ctx.raw("POST", "/detokenize", body=json.dumps({"tokens": json.loads(body)["tokens"]}))
    prompt = json.loads(text)["prompt"]
    assert "<parameter=filters>\n{\"rain\": {\"min\": 0.5}, \"hours\": [6, 18], \"alerts\": true, \"station\": null}\n</parameter>" in prompt, prompt
    assert "<parameter=note>\nfirst line\nsecond line\n</parameter>" in prompt, prompt
    # Without thinking, the answer is plain text.
    response = ctx.client.chat.completions.create(model=ctx.model, messages=messages, tools=tools, temperature=0, max_tokens=100,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert response.choices[0].message.content == ctx.args.expect_off_answer, response.choices[0].message
    assert not response.choices[0].message.tool_calls


@check
def tokenize(ctx):
    status, _, body = ctx.raw("POST", "/tokenize", body=json.dumps({"model": ctx.model, "prompt": "Hello world", "return_token_strs": True}))
    assert status == 200, body
    result = json.loads(body)
    assert result["tokens"] == [9707, 1879] and result["count"] == 2 and result["token_strs"] == ["Hello", " world"], result
    assert result["max_model_len"] > 0
    status, _, body = ctx.raw("POST", "/detokenize", body=json.dumps({"model": ctx.model, "tokens": [9707, 1879]}))
    assert status == 200 and json.loads(body) == {"prompt": "Hello world"}, body
    status, _, body = ctx.raw("POST", "/tokenize", body=json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    result = json.loads(body)
    assert status == 200 and result["count"] == ctx.args.expect_hi_prompt_tokens, (body, ctx.args.expect_hi_prompt_tokens)
    status, _, body = ctx.raw("POST", "/detokenize", body=json.dumps({"tokens": [999999999]}))
    assert_error(status, body, 400, want_param="tokens")
    status, _, body = ctx.raw("POST", "/tokenize", body=json.dumps({}))
    assert_error(status, body, 400, want_param="prompt")
    status, _, body = ctx.raw("POST", "/tokenize", body=json.dumps({"model": "other", "prompt": "x"}))
    assert_error(status, body, 400, want_param="model")


@check
def generation_errors(ctx):
    chat_path = "/v1/chat/completions"
    good = {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"n": 100}, "n"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ]
    for extra, param in cases:
        status, _, body = ctx.raw("POST", chat_path, body=json.dumps({**good, **extra}))
        assert_error(status, body, 400, want_param=param)
    status, _, body = ctx.raw("POST", "/v1/completions", body=json.dumps({"model": ctx.model, "prompt": "x", "logprobs": 21}))
    assert_error(status, body, 400, want_param="logprobs")
    try:
        ctx.client.chat.completions.create(model=ctx.model, messages=good["messages"], max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}})
        raise AssertionError("an uncompilable schema was accepted")
    except openai.BadRequestError as err:
        assert err.status_code == 400 and "response_format" in str(err), err
    # After all of that the server still answers, grammars included.
    response = ctx.client.chat.completions.create(model=ctx.model, messages=good["messages"], max_tokens=40, temperature=0,
                                                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["ok"]}}})
    assert response.choices[0].message.content == '"ok"', response.choices[0].message.content


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--expect-reply", default="")
    parser.add_argument("--expect-reply-tokens", type=int, default=0)
    parser.add_argument("--expect-tool-text", default="")
    parser.add_argument("--expect-tool-prompt-tokens", type=int, default=0)
    parser.add_argument("--body-limit", type=int, default=65536)
    parser.add_argument("--expect-reasoning", default="")
    parser.add_argument("--expect-answer", default="")
    parser.add_argument("--expect-off-answer", default="")
    parser.add_argument("--expect-off-prompt-tokens", type=int, default=0)
    parser.add_argument("--expect-hi-prompt-tokens", type=int, default=0)
    parser.add_argument("--allowed-origin", default="")
    parser.add_argument("--poison-word", default="")
    parser.add_argument("checks", nargs="+", choices=sorted(CHECKS))
    args = parser.parse_args()
    ctx = Context(args)
    for name in args.checks:
        CHECKS[name](ctx)
        print(f"PASS {name}", flush=True)


if __name__ == "__main__":
    main()
