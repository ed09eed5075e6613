"""End-to-end tests of `lunar serve` with the official OpenAI client.

    pip install openai pytest jsonschema httpx
    make && pytest -q tests/server/test_openai.py

Starts build/lunar serve on a free loopback port for each model and stops it at the end.
Environment:
  LUNAR_FAKE_ENGINE=1   serve with --fake-engine (scripted output; works before the engine is merged). The tests that
                        need real generation (tool calls, JSON output) are skipped then.
  LUNAR_TEST_MODEL      the Kimi-Linear model dir (default models/kimi-linear-tiny; K2 chat format, random weights:
                        outputs are gibberish but must be well-formed)
  LUNAR_TEST_K3_MODEL   a K3 model dir (default: a tiny random K3.1 with the full 163,840-token vocabulary and the Kimi
                        tokenizer, written to /tmp/lunar-k3-full-vocab by tests/server/make_k3_full_vocab.py)
  The constrained-decoding tests (strict tools over every JSON-schema case, stream and not; response_format
  json_schema / json_object, tool_choice none / named) run on the K2 model, and in the K3 format on the K3
  model: random weights wander, but the grammar and its token budget (server/constrain.c, engine/grammar.c)
  must end every output complete and valid within max_tokens (LUNAR_TEST_STRICT_MAX_TOKENS, default 256).
  LUNAR_TEST_STRICT_SUBSET=1 runs every 6th schema case only.
  LUNAR_SERVE_ARGS      extra flags for lunar serve (e.g. "--backend cuda").
"""
import concurrent.futures
import glob
import json
import os
import sys
import shlex
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schema_wrap import wrap  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LUNAR = os.path.join(ROOT, "build", "lunar")
FAKE = os.environ.get("LUNAR_FAKE_ENGINE") == "1"
K2_MODEL = os.environ.get("LUNAR_TEST_MODEL", os.path.join(ROOT, "models", "kimi-linear-tiny"))
K3_MODEL = os.environ.get("LUNAR_TEST_K3_MODEL", "/tmp/lunar-k3-full-vocab")
K3_GENERATOR = os.path.join(ROOT, "tests", "server", "make_k3_full_vocab.py")
NAME = "tiny"
MAX_TOKENS = 12

needs_engine = pytest.mark.skipif(FAKE, reason="needs real generation (LUNAR_FAKE_ENGINE=1)")
needs_grammar = pytest.mark.skipif(FAKE, reason="constrained decoding needs real generation (LUNAR_FAKE_ENGINE=1)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, *extra):
        self.port = free_port()
        args = [LUNAR, "serve", model_dir, "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", NAME, "--max-model-len", "4096", "--max-num-seqs", "64", *extra]
        if FAKE:
            args.append("--fake-engine")
        args += shlex.split(os.environ.get("LUNAR_SERVE_ARGS", ""))
        self.log = open(os.path.join("/tmp", f"lunar-serve-{self.port}.log"), "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 300  # model load
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lunar serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("lunar serve did not start")
            time.sleep(0.2)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=kw.pop("timeout", 300), **kw)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def k2():
    s = Server(K2_MODEL)
    yield s
    s.stop()
    assert s.proc.returncode in (0, -15), "lunar serve did not stop cleanly"


def k3_tokenizer_dir():
    """A K3 model dir without a tokenizer (tests/golden/k3-a) is served with the Kimi tokenizer + K3 table."""
    if os.path.exists(os.path.join(K3_MODEL, "tiktoken.model")):
        return []
    d = "/tmp/lunar-k3-tokenizer"
    os.makedirs(d, exist_ok=True)
    for dst, src in (("tiktoken.model", "tiktoken.model"), ("tokenizer_config.json", "tokenizer_config.k3.json")):
        if not os.path.exists(os.path.join(d, dst)):
            os.symlink(os.path.join(ROOT, "data", "kimi-tokenizer", src), os.path.join(d, dst))
    return ["--tokenizer", d]


def k3_full_vocab():
    c = json.load(open(os.path.join(K3_MODEL, "config.json")))
    return c.get("text_config", c).get("vocab_size", 0) >= 163840


@pytest.fixture(scope="module")
def k3():
    if "LUNAR_TEST_K3_MODEL" not in os.environ:  # the generated model, rewritten when its generator changes
        weights = os.path.join(K3_MODEL, "model.safetensors")
        if not os.path.exists(weights) or os.path.getmtime(weights) < os.path.getmtime(K3_GENERATOR):
            subprocess.run([sys.executable, K3_GENERATOR, K3_MODEL], check=True)
    if not os.path.exists(os.path.join(K3_MODEL, "config.json")):
        pytest.skip(f"no K3 model at {K3_MODEL}")
    s = Server(K3_MODEL, *k3_tokenizer_dir())
    yield s
    s.stop()


@pytest.fixture
def k3_gen(k3):
    """K3 tests that generate need a model whose vocabulary holds the Kimi tokenizer's ids."""
    if not k3_full_vocab() and not FAKE:
        pytest.skip("the K3 test model has a tiny vocabulary: the Kimi tokenizer's ids are out of range")
    return k3


def user(text="Say 'OK' and nothing else."):
    return [{"role": "user", "content": text}]


def reassemble(stream):
    """Rebuilds a streamed chat answer as KVV's conftest does."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None, "role": None, "chunks": 0,
           "name_sends": {}}
    for ch in stream:
        out["chunks"] += 1
        if ch.usage is not None:
            out["usage"] = ch.usage
        for c in ch.choices:
            d = c.delta
            if d.role:
                out["role"] = d.role
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index or 0, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["name"] += tc.function.name
                    out["name_sends"][tc.index or 0] = out["name_sends"].get(tc.index or 0, 0) + 1
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            if c.finish_reason:
                out["finish"] = c.finish_reason
    return out


def check_usage(u):
    assert isinstance(u.prompt_tokens, int) and isinstance(u.completion_tokens, int)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


# ---- basic surface ----

def test_models_health_metrics(k2):
    models = k2.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    r = httpx.get(k2.base + "/v1/models").json()
    assert r["data"][0]["root"] and r["data"][0]["max_model_len"] == 4096
    assert httpx.get(k2.base + "/health").status_code == 200
    text = httpx.get(k2.base + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert "lunar:" + name in text, name


def test_chat_non_stream(k2):
    r = k2.client().chat.completions.create(model=NAME, messages=user(), max_tokens=MAX_TOKENS)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    check_usage(r.usage)
    assert 1 <= r.usage.completion_tokens <= MAX_TOKENS


def test_chat_stream_reassembles_to_non_stream(k2):
    c = k2.client()
    kw = dict(model=NAME, messages=user("Count to five."), max_tokens=MAX_TOKENS, temperature=0, seed=1)
    whole = c.chat.completions.create(**kw)
    s = reassemble(c.chat.completions.create(stream=True, **kw))
    assert s["role"] == "assistant"
    assert s["content"] == (whole.choices[0].message.content or "")
    assert s["finish"] == whole.choices[0].finish_reason
    # usage comes at the end of every stream, also without stream_options
    assert s["usage"] is not None
    check_usage(s["usage"])
    assert s["usage"].completion_tokens == whole.usage.completion_tokens
    assert s["usage"].prompt_tokens == whole.usage.prompt_tokens


def test_stream_raw_sse_framing(k2):
    body = {"model": NAME, "messages": user(), "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", k2.base + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l]
    assert all(l.startswith("data: ") for l in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0
    assert sum(1 for c in chunks if c.get("usage") and not c["choices"]) == 1


def test_prompt_tokens_exact(k2):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界 " * 20}]
    t = httpx.post(k2.base + "/tokenize", json={"model": NAME, "messages": msgs}).json()
    r = k2.client().chat.completions.create(model=NAME, messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens == t["count"]  # K2 format: no stub tokens
    t2 = httpx.post(k2.base + "/tokenize", json={"prompt": "The capital of France is"}).json()
    r2 = k2.client().completions.create(model=NAME, prompt="The capital of France is", max_tokens=1)
    assert r2.usage.prompt_tokens == t2["count"]
    d = httpx.post(k2.base + "/detokenize", json={"tokens": t2["tokens"]}).json()
    assert d["prompt"] == "The capital of France is"


def test_completions(k2):
    c = k2.client()
    r = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=MAX_TOKENS, logprobs=2)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens
    check_usage(r.usage)
    ids = httpx.post(k2.base + "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    r2 = c.completions.create(model=NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    r3 = c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0)
    assert r2.choices[0].text == r3.choices[0].text
    text, usage, finish = "", None, None
    for ch in c.completions.create(model=NAME, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0,
                                   stream=True):
        usage = ch.usage or usage
        for x in ch.choices:
            text += x.text
            finish = x.finish_reason or finish
    assert text == r3.choices[0].text and finish == r3.choices[0].finish_reason and usage is not None


def test_n_and_stop_and_logprobs(k2):
    c = k2.client()
    r = c.chat.completions.create(model=NAME, messages=user(), max_tokens=MAX_TOKENS, n=3, seed=5)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(1 for _ in range(0)) or r.usage.completion_tokens >= 3
    r = c.chat.completions.create(model=NAME, messages=user(), max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) <= 2 for t in lp)
    full = c.completions.create(model=NAME, prompt="a b c", max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    if len(full) > 4:
        stop = full[2:4]
        cut = c.completions.create(model=NAME, prompt="a b c", max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
        assert cut.choices[0].text == full[:full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_reasoning_controls_accepted_k2(k2):
    c = k2.client()
    for extra in ({"thinking": {"type": "disabled"}}, {"chat_template_kwargs": {"thinking": False}},
                  {"reasoning_effort": "low"}):
        r = c.chat.completions.create(model=NAME, messages=user(), max_tokens=4, extra_body=extra)
        assert isinstance(r.choices[0].message.content, str)
        # Kimi-Linear has no thinking channel: no reasoning_content
        assert not getattr(r.choices[0].message, "reasoning_content", None)


# ---- errors ----

BAD = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, None),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "x"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"}, None),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "bogus"}, None),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "bogus"}}, None),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}, None),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "x"}}}, None),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}}, None),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "1bad_name"}}]}, None),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [None]}, None),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]}, None),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,param", BAD)
def test_400_before_any_sse(k2, body, param, stream):
    body = dict(body, model=NAME, stream=stream)
    r = httpx.post(k2.base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "code" in err and "param" in err
    if param:
        assert err["param"] == param
    assert "data:" not in r.text


def test_http_errors(k2):
    b = k2.base
    assert httpx.post(b + "/v1/chat/completions", content=b"{nope").status_code == 400
    assert httpx.post(b + "/v1/chat/completions", content=b'{"messages":[{"role":"user","content":"\xff"}]}').status_code == 400
    assert httpx.post(b + "/v1/chat/completions", json={"model": "gpt-4", "messages": user()}).status_code == 404
    assert httpx.get(b + "/v1/chat/completions").status_code == 405
    assert httpx.get(b + "/nope").status_code == 404
    big = b'{"messages":[{"role":"user","content":"' + b"a" * (33 << 20) + b'"}]}'
    try:
        assert httpx.post(b + "/v1/chat/completions", content=big, timeout=60).status_code == 413
    except httpx.HTTPError:
        pass  # the server may close the connection before the client has sent everything
    with pytest.raises(openai.BadRequestError):
        k2.client().chat.completions.create(model=NAME, messages=[], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        k2.client().chat.completions.create(model="nope", messages=user(), max_tokens=1)
    assert httpx.get(b + "/health").status_code == 200


def test_api_key():
    s = Server(K2_MODEL, "--api-key", "sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        r = httpx.get(s.base + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["message"]
        assert s.client(api_key="sekret").models.list().data[0].id == NAME
        assert httpx.get(s.base + "/health").status_code == 200
    finally:
        s.stop()


# ---- load and robustness ----

def test_64_concurrent_streams(k2):
    def one(i):
        c = k2.client()
        s = reassemble(c.chat.completions.create(model=NAME, messages=user(f"Client {i}: say hi."),
                                                 max_tokens=MAX_TOKENS, stream=True))
        assert s["role"] == "assistant" and s["finish"] in ("stop", "length")
        check_usage(s["usage"])
        return s["usage"].completion_tokens

    with concurrent.futures.ThreadPoolExecutor(64) as ex:
        counts = list(ex.map(one, range(64)))
    assert all(1 <= n <= MAX_TOKENS for n in counts)


def test_client_disconnect_mid_stream(k2):
    body = {"model": NAME, "messages": user("Write a long story."), "max_tokens": 3000, "stream": True,
            "ignore_eos": True}
    for _ in range(3):
        with httpx.stream("POST", k2.base + "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and "content" in line:
                    break  # leave after the first delta: the connection closes
    # the server stays responsive and the abandoned requests are cancelled
    r = k2.client().chat.completions.create(model=NAME, messages=user(), max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    deadline = time.time() + 60
    while time.time() < deadline:
        m = httpx.get(k2.base + "/metrics").text
        running = [l for l in m.splitlines() if l.startswith("lunar:num_requests_running")]
        if running and running[0].endswith(" 0"):
            break
        time.sleep(0.5)
    else:
        pytest.fail("abandoned streams still running")


# ---- constrained decoding (needs the grammar) ----

def schema_cases():
    """Every schema case (stream and non-stream: 182 requests, batched by the engine; ~4 CPU-minutes of
    the random model at max_tokens 256, since the token budget closes every call); every 6th with
    LUNAR_TEST_STRICT_SUBSET=1."""
    every = 6 if os.environ.get("LUNAR_TEST_STRICT_SUBSET") else 1
    return all_schema_cases()[::every]


def all_schema_cases():
    for base in (os.path.join(ROOT, "tests", "data", "json-schema-cases"), "/work/shared/data/json-schema-cases",
                 os.path.join(ROOT, "data", "json-schema-cases")):
        files = sorted(glob.glob(os.path.join(base, "*", "valid.jsonl")))
        if files:
            break
    out = []
    for f in files:
        for i, line in enumerate(open(f, encoding="utf-8")):
            if line.strip():
                out.append(pytest.param(json.loads(line), id=f"{os.path.basename(os.path.dirname(f))}-{i}"))
    return out


# Random weights wander inside free strings: the engine's token budget closes every constrained
# output before max_tokens (finish_reason "length" when the budget had to act), so every call ends
# with complete, valid arguments; the bound only keeps the CPU run short.
STRICT_MAX_TOKENS = int(os.environ.get("LUNAR_TEST_STRICT_MAX_TOKENS", "256"))

# The one case whose minLength (999999999999) no context can hold: refused with a 400 when compiled
# (as in tests/test_grammar.c).
UNSATISFIABLE = {"RangeConstraints-2"}


def strict_call(server, schema, stream):
    """One strict-tool request (KVV tool_call_json_schema); returns (name, arguments, finish, name_sends)."""
    wrapped = wrap(schema)
    tool = {"type": "function", "function": {"name": "kvv_walle_case", "description":
            "Submit minimal JSON arguments that validate against this JSON Schema.", "parameters": wrapped,
            "strict": True}}
    kw = dict(model=NAME, messages=user("Call kvv_walle_case once with minimal valid arguments."), tools=[tool],
              tool_choice="required", max_tokens=STRICT_MAX_TOKENS, seed=1)
    c = server.client(timeout=7200)  # all cases are queued at once; on CPU the random model is slow
    if stream:
        s = reassemble(c.chat.completions.create(stream=True, **kw))
        call = s["calls"].get(0, {"name": None, "arguments": None})
        return call["name"], call["arguments"], s["finish"], s["name_sends"]
    r = c.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert not calls or all(tc.id for tc in calls)
    return (calls[0].function.name if calls else None, calls[0].function.arguments if calls else None,
            r.choices[0].finish_reason, {})


@pytest.fixture(scope="module")
def strict_results(k2):
    """All strict-tool requests at once (the engine batches them; the K2 model's random weights need many tokens)."""
    cases = [(p.id, p.values[0], stream) for p in schema_cases() for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(48) as ex:
        futs = {(cid, stream): ex.submit(strict_call, k2, schema, stream) for cid, schema, stream in cases}
        return {k: f for k, f in futs.items()}


@needs_grammar
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("schema", schema_cases())
def test_strict_tool_schema(request, strict_results, schema, stream):
    import jsonschema
    cid = request.node.callspec.id.rsplit("-", 1)[0]
    if cid in UNSATISFIABLE:
        with pytest.raises(openai.BadRequestError) as e:
            strict_results[(cid, stream)].result()
        assert "minLength 999999999999" in str(e.value)
        return
    name, args, finish, sends = strict_results[(cid, stream)].result()
    # "length": the budget closed the call early; its arguments are complete and valid all the same
    assert finish in ("tool_calls", "length"), f"finish_reason {finish} (arguments {str(args)[:200]})"
    assert all(n == 1 for n in sends.values()), "the name must be sent once"
    assert name == "kvv_walle_case"
    jsonschema.Draft202012Validator(wrap(schema)).validate(json.loads(args))


@needs_grammar
def test_strict_tools_finish(strict_results):
    """Every strict call ends with one whole call, within max_tokens: by itself ("tool_calls") or closed
    by the token budget ("length"); random weights wander, so the budget closes most of them."""
    done = [k for k in strict_results if k[0] not in UNSATISFIABLE]
    results = [strict_results[k].result() for k in done]
    assert all(r[0] == "kvv_walle_case" and r[1] for r in results), "a strict call without arguments"
    print(f"{sum(r[2] == 'tool_calls' for r in results)} of {len(results)} strict calls ended by themselves")


@needs_grammar
def test_response_format(k2):
    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temperature": {"type": "number"}},
              "required": ["city", "temperature"], "additionalProperties": False}

    def one(rf, stream):
        kw = dict(model=NAME, messages=user("Weather in Paris as JSON."), response_format=rf, max_tokens=STRICT_MAX_TOKENS,
                  seed=7)
        c = k2.client()
        if stream:
            s = reassemble(c.chat.completions.create(stream=True, **kw))
            return s["content"], s["finish"]
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    # a schema with no free strings: the grammar leaves the model nowhere to wander, so even random
    # weights must finish it
    bounded = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
               "maximum": 9}, "unit": {"enum": ["C", "F"]}}, "required": ["ok", "n", "unit"], "additionalProperties": False}
    rfs = [{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": schema}},
           {"type": "json_schema", "json_schema": {"name": "w", "strict": False, "schema": schema}},
           {"type": "json_schema", "json_schema": {"name": "b", "strict": True, "schema": bounded}}]
    jobs = [(rf, stream) for rf in rfs for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(lambda j: one(*j), jobs))
    for (rf, stream), (content, finish) in zip(jobs, results):
        if rf.get("json_schema", {}).get("name") == "b":
            assert finish == "stop", (stream, finish, content[:200])
        assert finish in ("stop", "length"), (rf["type"], stream, finish, content[:200])
        assert "\n" not in content and "\t" not in content  # compact JSON
        v = json.loads(content)  # "length": closed by the token budget, complete all the same
        assert isinstance(v, dict)
        if rf["type"] == "json_schema":  # lunar enforces the schema with strict false too
            jsonschema.validate(v, rf["json_schema"]["schema"])


@needs_grammar
def test_tool_choice_none_and_named(k2):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties":
              {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}, "strict": True}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties":
              {"tz": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["tz"],
              "additionalProperties": False}, "strict": True}}]
    c = k2.client()
    kw = dict(model=NAME, messages=user("What is the weather in Paris?"), tools=tools, max_tokens=64)
    r = c.chat.completions.create(tool_choice="none", **kw)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    kw["max_tokens"] = 512
    r = c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for tc in calls:
        assert tc.function.name == "get_time"
        assert -12 <= json.loads(tc.function.arguments)["tz"] <= 12


# ---- K3 (XTML chat format: the generated full-vocabulary tiny K3.1, random weights) ----

def test_k3_sampling_guard_accepts(k3_gen):
    c = k3_gen.client()
    for kw in ({}, {"temperature": 0.6}, {"temperature": 0.0}, {"temperature": 1.0}, {"top_p": 0.95},
               {"presence_penalty": 0}, {"frequency_penalty": 0}, {"n": 1}):
        r = c.chat.completions.create(model=NAME, messages=user(), max_tokens=4, **kw)
        assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls


def test_k3_sampling_guard_rejects(k3):
    c = k3.client()
    for kw in ({"temperature": 1.1}, {"temperature": 2.0}, {"temperature": -0.1}, {"top_p": 0.8},
               {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"n": 2}):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model=NAME, messages=user(), max_tokens=4, **kw)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}]},
    {"messages": [{"role": "system", "content": "nonempty", "tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"role": "user", "content": "x"}]},
    {"messages": [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
])
def test_k3_dynamic_tools_400(k3, body):
    for stream in (False, True):
        r = httpx.post(k3.base + "/v1/chat/completions", json=dict(body, model=NAME, stream=stream), timeout=60)
        assert r.status_code == 400 and "data:" not in r.text


def test_k3_prompt_tokens_kvv_constants(k3_gen):
    k3 = k3_gen
    """KVV's exact counts (reference/kvv.md §5): 36 and 119. Needs the full Kimi vocabulary in the model dir."""
    text = "请用 JSON 格式回答：北京是中国的首都吗？答案需要包含键 capital。"
    base = {"model": NAME, "messages": [{"role": "user", "content": text}], "thinking": {"type": "disabled"},
            "max_tokens": 1}
    r = httpx.post(k3.base + "/v1/chat/completions", json=base, timeout=300).json()
    schema = {"type": "object", "properties": {"capital": {"type": "boolean"}}, "required": ["capital"],
              "additionalProperties": False}
    r2 = httpx.post(k3.base + "/v1/chat/completions", timeout=300, json=dict(
        base, response_format={"type": "json_schema", "json_schema": {"name": "capital_answer", "strict": True,
                                                                      "schema": schema}})).json()
    assert r["usage"]["prompt_tokens"] == 36
    assert r2["usage"]["prompt_tokens"] == 119


@pytest.mark.parametrize("stream", [False, True])
def test_k3_reasoning_on_off(k3_gen, stream):
    c = k3_gen.client()
    for thinking, extra in ((True, {}), (True, {"thinking": {"type": "enabled", "effort": "low"}}),
                            (False, {"thinking": {"type": "disabled"}}), (False, {"reasoning_effort": "none"})):
        kw = dict(model=NAME, messages=user(), max_tokens=16, extra_body=extra)
        if stream:
            s = reassemble(c.chat.completions.create(stream=True, **kw))
            check_usage(s["usage"])
            if not thinking:
                assert s["reasoning"] == ""
        else:
            m = c.chat.completions.create(**kw).choices[0].message
            assert hasattr(m, "reasoning_content") == thinking or (m.reasoning_content is not None) == thinking


K3_MAX = 48  # the random K3 decodes ~20 tokens/s per request on CPU; the budget closes constrained outputs in time


def k3_one(server, stream, **kw):
    """One K3 chat request: (content, reasoning, calls {index: {name, arguments}}, finish, usage, name_sends)."""
    c = server.client()
    kw = dict(dict(model=NAME, messages=user("Answer in JSON."), max_tokens=K3_MAX, seed=3), **kw)
    if stream:
        s = reassemble(c.chat.completions.create(stream=True, **kw))
        return s["content"], s["reasoning"], s["calls"], s["finish"], s["usage"], s["name_sends"]
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    calls = {i: {"name": tc.function.name, "arguments": tc.function.arguments, "id": tc.id}
             for i, tc in enumerate(m.tool_calls or [])}
    return (m.content or "", getattr(m, "reasoning_content", None) or "", calls, r.choices[0].finish_reason, r.usage,
            {})


def test_k3_chat_stream_reassembles(k3_gen):
    """Greedy: the streamed answer, reassembled, is the non-streamed one (reasoning and content channels)."""
    for extra in ({}, {"thinking": {"type": "disabled"}}):
        a = k3_one(k3_gen, False, temperature=0, extra_body=extra)
        b = k3_one(k3_gen, True, temperature=0, extra_body=extra)
        assert (a[0], a[1], a[3]) == (b[0], b[1], b[3])
        check_usage(a[4]), check_usage(b[4])
        assert a[4].completion_tokens == b[4].completion_tokens <= K3_MAX
        if extra:
            assert a[1] == ""


K3_RFS = [{"type": "json_object"},
          {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": {
              "type": "object", "properties": {"city": {"type": "string"}, "t": {"type": "number", "minimum": -50,
                                                                                   "maximum": 60}},
              "required": ["city", "t"], "additionalProperties": False}}}]


def test_k3_response_format(k3_gen):
    """response_format in the response channel, thinking on and off, stream and not: compact JSON that
    validates, closed by the token budget at the latest ("length" then)."""
    import jsonschema
    jobs = [(rf, think, stream) for rf in K3_RFS for think in (True, False) for stream in (False, True)]

    def run(job):
        rf, think, stream = job
        extra = {} if think else {"thinking": {"type": "disabled"}}
        return k3_one(k3_gen, stream, response_format=rf, extra_body=extra)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        results = list(ex.map(run, jobs))
    for (rf, think, stream), (content, reasoning, calls, finish, usage, _) in zip(jobs, results):
        assert finish in ("stop", "length") and not calls, (rf["type"], think, stream, finish)
        assert "\n" not in content and "\t" not in content, content
        v = json.loads(content)
        assert isinstance(v, dict)
        if rf["type"] == "json_schema":
            jsonschema.validate(v, rf["json_schema"]["schema"])
        if not think:
            assert reasoning == ""
        check_usage(usage)
        assert usage.completion_tokens <= K3_MAX


@pytest.mark.parametrize("schema", all_schema_cases()[::15])
def test_k3_strict_tools(k3_gen, schema):
    """Strict tools in the K3 tools channel (tool_choice required), stream and not: one call or more, the
    name sent once, arguments valid for the schema (closed by the budget at the latest)."""
    import jsonschema
    tool = {"type": "function", "function": {"name": "kvv_walle_case", "parameters": wrap(schema), "strict": True}}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(k3_one, k3_gen, stream, tools=[tool], tool_choice="required", max_tokens=96)
                for stream in (False, True)]
        results = [f.result() for f in futs]
    for content, reasoning, calls, finish, usage, sends in results:
        assert finish in ("tool_calls", "length") and calls, (finish, content[:200])
        assert all(n == 1 for n in sends.values())
        for call in calls.values():
            assert call["name"] == "kvv_walle_case"
            jsonschema.Draft202012Validator(wrap(schema)).validate(json.loads(call["arguments"]))
        check_usage(usage)


def test_k3_tool_choice_none_and_unsatisfiable(k3_gen):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for stream in (False, True):
        content, reasoning, calls, finish, usage, _ = k3_one(k3_gen, stream, tools=[tool], tool_choice="none")
        assert not calls and finish in ("stop", "length")
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 999999999999}}}
    for stream in (False, True):
        r = httpx.post(k3_gen.base + "/v1/chat/completions", timeout=60,
                       json={"model": NAME, "messages": user(), "response_format": bad, "stream": stream})
        assert r.status_code == 400 and "data:" not in r.text and "minLength 999999999999" in r.text
