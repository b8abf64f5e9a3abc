"""A table of bad requests: each gets its status, OpenAI's error shape and
the field at fault in `param`; none of them hurts the daemon (its stderr is
checked for sanitizer reports at teardown, and it must still serve after)."""
import json
import socket

import pytest

from conftest import HTTP_TIMEOUT, scaled

GEN = "/v1/images/generations"
BODY_LIMIT = 65536  # tiny_daemon's --max-body-bytes


def ok(**kw):
    """A valid body with kw changed."""
    return json.dumps({"prompt": "a red circle", **kw}).encode()


def long_number(field, sign=""):
    """A valid body whose field is a number written with 400 digits."""
    return b'{"prompt": "a red circle", "%s": %s%s}' % (field.encode(), sign.encode(), b"9" * 400)


# (id, method, path, raw body or None, status, param, code)
CASES = [
    # malformed JSON
    ("empty-body", "POST", GEN, b"", 400, None, "invalid_json"),
    ("whitespace-body", "POST", GEN, b"  \n ", 400, None, "invalid_json"),
    ("truncated-json", "POST", GEN, b'{"prompt": "a red', 400, None, "invalid_json"),
    ("not-json", "POST", GEN, b"prompt=a+red+circle", 400, None, "invalid_json"),
    ("trailing-garbage", "POST", GEN, b'{"prompt": "a"} x', 400, None, "invalid_json"),
    ("two-objects", "POST", GEN, b'{"prompt": "a"}{"prompt": "b"}', 400, None, "invalid_json"),
    ("array-body", "POST", GEN, b'[{"prompt": "a"}]', 400, None, "invalid_json"),
    ("string-body", "POST", GEN, b'"a red circle"', 400, None, "invalid_json"),
    ("invalid-utf8", "POST", GEN, b'{"prompt": "a \xff circle"}', 400, None, "invalid_json"),
    ("nul-escape", "POST", GEN, b'{"prompt": "a\\u0000b"}', 400, "prompt", "invalid_value"),
    ("raw-control-char", "POST", GEN, b'{"prompt": "a\x01b"}', 400, None, "invalid_json"),
    ("deep-nesting", "POST", GEN, b'{"prompt": "a", "user": ' + b"[" * 100 + b"]" * 100 + b"}",
     400, None, "invalid_json"),
    # wrong types
    ("prompt-number", "POST", GEN, b'{"prompt": 5}', 400, "prompt", "invalid_type"),
    ("prompt-array", "POST", GEN, b'{"prompt": ["a"]}', 400, "prompt", "invalid_type"),
    ("n-string", "POST", GEN, ok(n="2"), 400, "n", "invalid_type"),
    ("n-fraction", "POST", GEN, ok(n=1.5), 400, "n", "invalid_type"),
    ("n-bool", "POST", GEN, ok(n=True), 400, "n", "invalid_type"),
    ("seed-string", "POST", GEN, ok(seed="7"), 400, "seed", "invalid_type"),
    ("seed-fraction", "POST", GEN, ok(seed=7.5), 400, "seed", "invalid_type"),
    ("size-number", "POST", GEN, ok(size=32), 400, "size", "invalid_type"),
    ("stream-string", "POST", GEN, ok(stream="yes"), 400, "stream", "invalid_type"),
    ("temperature-string", "POST", GEN, ok(temperature="hot"), 400, "temperature",
     "invalid_type"),
    ("model-number", "POST", GEN, ok(model=3), 400, "model", "invalid_type"),
    # unknown and duplicate fields
    ("unknown-field", "POST", GEN, ok(quality_boost=1), 400, "quality_boost",
     "unknown_parameter"),
    ("unknown-openai-field", "POST", GEN, ok(style="vivid"), 400, "style",
     "unknown_parameter"),
    ("duplicate-field", "POST", GEN, b'{"prompt": "a", "n": 1, "n": 2}', 400, "n",
     "duplicate_parameter"),
    # out of range
    ("n-zero", "POST", GEN, ok(n=0), 400, "n", "invalid_value"),
    ("n-negative", "POST", GEN, ok(n=-1), 400, "n", "invalid_value"),
    ("n-above-max", "POST", GEN, ok(n=5), 400, "n", "invalid_value"),
    ("n-huge", "POST", GEN, ok(n=1e300), 400, "n", "invalid_value"),
    ("seed-negative", "POST", GEN, ok(seed=-1), 400, "seed", "invalid_value"),
    ("seed-2^53", "POST", GEN, ok(seed=2**53), 400, "seed", "invalid_value"),
    ("top-p-zero", "POST", GEN, ok(top_p=0), 400, "top_p", "invalid_value"),
    ("top-k-above-codebook", "POST", GEN, ok(top_k=100000), 400, "top_k", "invalid_value"),
    ("temperature-negative", "POST", GEN, ok(temperature=-0.5), 400, "temperature",
     "invalid_value"),
    ("guidance-too-large", "POST", GEN, ok(guidance_scale=1000), 400, "guidance_scale",
     "invalid_value"),
    ("partial-images-4", "POST", GEN, ok(stream=True, partial_images=4), 400,
     "partial_images", "invalid_value"),
    ("kv-policy-unknown", "POST", GEN, ok(kv_policy="magic"), 400, "kv_policy",
     "invalid_value"),
    ("kv-budget-above-1", "POST", GEN, ok(kv_budget=1.5), 400, "kv_budget", "invalid_value"),
    # numbers longer than cJSON reads (63 characters): their field's range check, not
    # invalid_json without a field
    ("seed-400-digits", "POST", GEN, long_number("seed"), 400, "seed", "invalid_value"),
    ("n-400-digits", "POST", GEN, long_number("n"), 400, "n", "invalid_value"),
    ("top-k-400-digits", "POST", GEN, long_number("top_k"), 400, "top_k", "invalid_value"),
    ("partial-images-400-digits", "POST", GEN, long_number("partial_images"), 400,
     "partial_images", "invalid_value"),
    ("seed-minus-400-digits", "POST", GEN, long_number("seed", "-"), 400, "seed",
     "invalid_value"),
    ("temperature-400-digits", "POST", GEN, long_number("temperature"), 400, "temperature",
     "invalid_value"),
    # sizes and formats
    ("size-not-served", "POST", GEN, ok(size="1024x1024"), 400, "size", "invalid_value"),
    ("size-garbage", "POST", GEN, ok(size="big"), 400, "size", "invalid_value"),
    ("size-zero", "POST", GEN, ok(size="0x0"), 400, "size", "invalid_value"),
    ("size-transposed-junk", "POST", GEN, ok(size="32x32x32"), 400, "size", "invalid_value"),
    ("response-format-url", "POST", GEN, ok(response_format="url"), 400, "response_format",
     "unsupported_value"),
    ("output-format-jpeg", "POST", GEN, ok(output_format="jpeg"), 400, "output_format",
     "unsupported_value"),
    # the prompt
    ("empty-prompt", "POST", GEN, ok(prompt=""), 400, "prompt", "invalid_value"),
    ("missing-prompt", "POST", GEN, b'{"n": 1}', 400, "prompt", "missing_required_parameter"),
    ("null-prompt", "POST", GEN, b'{"prompt": null}', 400, "prompt",
     "missing_required_parameter"),
    ("prompt-too-long", "POST", GEN, ok(prompt="a " * 4000), 400, "prompt", "invalid_value"),
    # body size, method, route
    ("oversized-body", "POST", GEN, ok(user="x" * (BODY_LIMIT + 1)), 413, None, None),
    ("get-generations", "GET", GEN, None, 405, None, None),
    ("put-generations", "PUT", GEN, ok(), 405, None, None),
    ("post-health", "POST", "/health", ok(), 405, None, None),
    ("post-models", "POST", "/v1/models", ok(), 405, None, None),
    ("delete-metrics", "DELETE", "/metrics", None, 405, None, None),
    ("unknown-route", "GET", "/v1/nope", None, 404, None, None),
    ("unknown-route-post", "POST", "/v1/images/edits", ok(), 404, None, None),
    ("route-prefix", "GET", "/v1/models/extra", None, 404, None, None),
    ("post-root", "POST", "/", ok(), 405, None, None),
    ("root-file", "GET", "/index.html", None, 404, None, None),
]


@pytest.mark.parametrize("method,path,body,status,param,code",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(tiny_daemon, method, path, body, status, param, code):
    before = tiny_daemon.metrics()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    r = tiny_daemon.client.request(method, path, content=body, headers=headers)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if status == 405:
        assert r.headers.get("allow") in ("GET", "POST")
    if status == 400 and param == "size" and code == "invalid_value":
        assert "32x32" in err["message"], "a size error lists the allowed sizes"
    # Counted under its code; nothing reached the engine.
    after = tiny_daemon.metrics()
    assert after.http_codes().get(str(status), 0) > before.http_codes().get(str(status), 0)
    assert after.get("arserve_iterations_total") == before.get("arserve_iterations_total")


@pytest.mark.parametrize("field", ["seed", "n", "top_k"])
def test_a_400_digit_number_is_out_of_its_fields_range(tiny_daemon, field):
    r = tiny_daemon.client.post(GEN, content=long_number(field),
                                headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (field, "invalid_value"), err
    assert err["message"].startswith(f"{field} must be an integer from "), err
    assert err["message"].endswith("got a number too large for a double"), err


def test_daemon_serves_after_every_bad_request(tiny_daemon):
    r = tiny_daemon.client.post(GEN, json={"prompt": "a red circle", "seed": 5})
    assert r.status_code == 200, r.text
    codes = tiny_daemon.metrics().http_codes()
    assert not any(c.startswith("5") for c in codes), codes


def raw_request(daemon, data, timeout=10.0):
    """Sends raw bytes on a fresh connection; returns the status line (timeout: the
    reference machine's seconds, scaled here)."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=scaled(timeout)) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\r\n", 1)[0].decode("latin-1")


def test_oversized_chunked_body_is_413(tiny_daemon):
    """A body without Content-Length (chunked) over the limit is cut off too."""
    def chunks():
        piece = b'{"prompt": "a", "user": "' + b"x" * 8192
        yield piece
        for _ in range(BODY_LIMIT // 8192 + 2):
            yield b"x" * 8192
        yield b'"}'
    r = tiny_daemon.client.post(GEN, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_garbage_http_does_not_crash(tiny_daemon):
    status = raw_request(tiny_daemon, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == "" or status.startswith("HTTP/1.1 4"), status
    status = raw_request(tiny_daemon, b"POST " + GEN.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 5\r\n\r\n{\"pr")  # body shorter than declared
    assert status == "" or status.startswith("HTTP/1.1 4"), status
    assert tiny_daemon.client.get("/health", timeout=HTTP_TIMEOUT).status_code == 200


# ---- the API key: a table of its own, on a daemon started with one ------

KEY = "sk-test-0123456789abcdef"

# (id, method, path, body, headers)
CASES_401 = [
    ("missing-key", "POST", GEN, ok(), {}),
    ("wrong-key", "POST", GEN, ok(), {"Authorization": "Bearer wrong-key"}),
    ("key-plus-a-byte", "POST", GEN, ok(), {"Authorization": f"Bearer {KEY}x"}),
    ("key-less-a-byte", "POST", GEN, ok(), {"Authorization": f"Bearer {KEY[:-1]}"}),
    ("basic-scheme", "POST", GEN, ok(), {"Authorization": f"Basic {KEY}"}),
    ("no-scheme", "POST", GEN, ok(), {"Authorization": KEY}),
    ("bearer-without-token", "POST", GEN, ok(), {"Authorization": "Bearer"}),
    ("bad-body-and-no-key", "POST", GEN, b"{not json", {}),
    ("get-models-no-key", "GET", "/v1/models", None, {}),
    ("get-models-wrong-key", "GET", "/v1/models", None, {"Authorization": "Bearer nope"}),
    ("get-job-no-key", "GET", "/v1/images/jobs/job_0123456789abcdef", None, {}),
]  # /ready, like /health, is a probe's and open (test_api.py)


@pytest.fixture(scope="module")
def keyed_daemon(tmp_path_factory):
    from conftest import TINY_MODEL, Daemon
    d = Daemon(str(tmp_path_factory.mktemp("arserve")), TINY_MODEL,
               env={"ARSERVE_API_KEY": KEY})
    yield d
    d.finish()


@pytest.mark.parametrize("method,path,body,headers", [c[1:] for c in CASES_401],
                         ids=[c[0] for c in CASES_401])
def test_missing_or_wrong_api_key_is_401(keyed_daemon, method, path, body, headers):
    r = keyed_daemon.client.request(method, path, content=body, headers=headers)
    assert r.status_code == 401, f"{r.status_code} {r.text}"
    assert r.headers.get("www-authenticate", "").startswith("Bearer")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error"
    assert err["param"] is None
    assert err["code"] == "invalid_api_key"
    assert err["message"]
    # Nothing was generated for an unauthenticated request.
    assert keyed_daemon.metrics().get("arserve_iterations_total") == 0
