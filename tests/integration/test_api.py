"""The OpenAI-compatible API as clients use it: the official `openai` client,
raw PNG responses, seeded determinism, the model list and the API key."""
import base64
import re
import time

import httpx
import openai
import pytest

from conftest import HTTP_TIMEOUT, TINY_MODEL, b64_png_size, capacity_cells, png_size

GEN = "/v1/images/generations"


def openai_client(daemon, api_key="unused"):
    # max_retries=0: a 429 or 5xx must reach the test, not be retried away.
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key=api_key, timeout=HTTP_TIMEOUT,
                         max_retries=0)


def test_openai_client_generates_png_of_requested_size(tiny_daemon, tiny_info):
    client = openai_client(tiny_daemon)
    result = client.images.generate(model=tiny_info["model"], prompt="a red circle on the left",
                                    size=tiny_info["size"], n=2, response_format="b64_json",
                                    output_format="png", extra_body={"seed": 7})
    assert len(result.data) == 2
    for item in result.data:
        assert b64_png_size(item.b64_json) == (tiny_info["width"], tiny_info["height"])
    assert result.size == tiny_info["size"]
    assert result.output_format == "png"
    assert result.created > 0
    # Two images from one request are different images.
    assert result.data[0].b64_json != result.data[1].b64_json
    u = result.usage
    assert u.output_tokens == 2 * tiny_info["steps"]
    assert u.input_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens


def test_openai_client_size_auto_and_defaults(tiny_daemon, tiny_info):
    client = openai_client(tiny_daemon)
    result = client.images.generate(prompt="a blue square", size="auto")
    assert len(result.data) == 1
    assert b64_png_size(result.data[0].b64_json) == (tiny_info["width"], tiny_info["height"])


def test_openai_client_raises_bad_request_with_param(tiny_daemon):
    client = openai_client(tiny_daemon)
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="a blue square", size="1024x1024")
    assert e.value.status_code == 400
    assert e.value.param == "size"
    assert e.value.code == "invalid_value"


def test_accept_image_png_returns_raw_png(tiny_daemon, tiny_info):
    r = tiny_daemon.client.post(GEN, json={"prompt": "a green triangle", "seed": 3},
                                headers={"Accept": "image/png"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    assert png_size(r.content) == (tiny_info["width"], tiny_info["height"])


def test_accept_image_png_is_the_same_image_as_b64_json(tiny_daemon):
    body = {"prompt": "a green triangle", "seed": 11}
    raw = tiny_daemon.client.post(GEN, json=body, headers={"Accept": "image/png"})
    js = tiny_daemon.client.post(GEN, json=body)
    assert raw.status_code == 200 and js.status_code == 200
    assert js.headers["content-type"].startswith("application/json")
    assert base64.b64decode(js.json()["data"][0]["b64_json"]) == raw.content


def test_accept_image_png_with_n_2_falls_back_to_json(tiny_daemon):
    r = tiny_daemon.client.post(GEN, json={"prompt": "a green triangle", "seed": 3, "n": 2},
                                headers={"Accept": "image/png"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert len(r.json()["data"]) == 2


def test_timings_split_the_latency(tiny_daemon, tiny_info):
    """The `timings` extension: queue wait, run time over every step, and
    decode+PNG time, each non-negative, together within what the client
    measured."""
    t0 = time.monotonic()
    r = tiny_daemon.client.post(GEN, json={"prompt": "a blue square", "seed": 5})
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    assert t["steps"] == tiny_info["steps"]
    assert t["queue_s"] >= 0 and t["run_s"] > 0 and t["decode_png_s"] > 0, t
    assert t["queue_s"] + t["run_s"] + t["decode_png_s"] <= elapsed, (t, elapsed)


def test_same_seed_gives_same_bytes(tiny_daemon):
    body = {"prompt": "two red circles above a blue square", "seed": 123456789}
    a = tiny_daemon.client.post(GEN, json=body, headers={"Accept": "image/png"})
    b = tiny_daemon.client.post(GEN, json=body, headers={"Accept": "image/png"})
    other = tiny_daemon.client.post(GEN, json={**body, "seed": 123456790},
                                    headers={"Accept": "image/png"})
    assert a.status_code == b.status_code == other.status_code == 200
    assert a.content == b.content
    assert a.content != other.content, "a different seed gave the same image"


def test_largest_seed_is_accepted_and_deterministic(tiny_daemon):
    body = {"prompt": "a red circle", "seed": 2**53 - 1}
    a = tiny_daemon.client.post(GEN, json=body, headers={"Accept": "image/png"})
    b = tiny_daemon.client.post(GEN, json=body, headers={"Accept": "image/png"})
    assert a.status_code == 200 and b.status_code == 200
    assert a.content == b.content


def test_openai_client_models_list(tiny_daemon, tiny_info):
    models = openai_client(tiny_daemon).models.list()
    ids = [m.id for m in models.data]
    assert ids == [tiny_info["model"]]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by == "arserve"


def test_wrong_model_is_404_model_not_found(tiny_daemon):
    r = tiny_daemon.client.post(GEN, json={"prompt": "a red circle", "model": "dall-e-3"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"


def test_served_model_names_are_answered(start_daemon, tiny_info):
    """--served-model-name: the first name is the id GET /v1/models gives; a
    request's `model` may be any of them (clients written for another server
    send theirs); any other name is a 404 listing them."""
    d = start_daemon(TINY_MODEL, ["--served-model-name", "dall-e-3,shapes"])
    client = openai_client(d)
    assert [m.id for m in client.models.list().data] == ["dall-e-3"]
    for name in ("dall-e-3", "shapes"):
        img = client.images.generate(model=name, prompt="a red circle", response_format="b64_json")
        assert png_size(base64.b64decode(img.data[0].b64_json)) == \
            (tiny_info["width"], tiny_info["height"])
    r = d.client.post(GEN, json={"prompt": "a red circle", "model": tiny_info["model"]})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found", err
    assert "serves 'dall-e-3,shapes'" in err["message"], err


def test_health_ready_metrics_answer(tiny_daemon):
    assert tiny_daemon.client.get("/health").status_code == 200
    assert tiny_daemon.client.get("/ready").status_code == 200
    r = tiny_daemon.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "version=0.0.4" in r.headers["content-type"]
    assert "arserve_build_info{" in r.text


# ---- the API key --------------------------------------------------------

KEY = "sk-test-0123456789abcdef"


@pytest.fixture
def keyed_daemon(start_daemon):
    return start_daemon(env={"ARSERVE_API_KEY": KEY})


def assert_401(r):
    assert r.status_code == 401, f"{r.status_code} {r.text}"
    assert r.headers.get("www-authenticate", "").startswith("Bearer")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_api_key"
    assert err["message"]


def test_api_key_right_key_is_200(keyed_daemon, tiny_info):
    auth = {"Authorization": f"Bearer {KEY}"}
    c = keyed_daemon.client
    r = c.post(GEN, json={"prompt": "a red circle", "seed": 1}, headers=auth)
    assert r.status_code == 200, r.text
    assert b64_png_size(r.json()["data"][0]["b64_json"]) == (tiny_info["width"],
                                                            tiny_info["height"])
    assert c.get("/v1/models", headers=auth).status_code == 200
    assert c.get("/ready", headers=auth).status_code == 200


def test_api_key_openai_client(keyed_daemon, tiny_info):
    result = openai_client(keyed_daemon, KEY).images.generate(prompt="a red circle",
                                                              extra_body={"seed": 2})
    assert b64_png_size(result.data[0].b64_json) == (tiny_info["width"], tiny_info["height"])
    assert [m.id for m in openai_client(keyed_daemon, KEY).models.list().data] == [
        tiny_info["model"]]
    with pytest.raises(openai.AuthenticationError) as e:
        openai_client(keyed_daemon, "sk-wrong").images.generate(prompt="a red circle")
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"


def test_api_key_not_needed_for_health_ready_and_metrics(keyed_daemon):
    c = keyed_daemon.client
    assert c.get("/health").status_code == 200
    assert c.get("/ready").status_code == 200  # a readiness probe carries no key
    r = c.get("/metrics")
    assert r.status_code == 200
    assert "arserve_build_info" in r.text
    # And a wrong key there does not turn them into 401s either.
    assert c.get("/health", headers={"Authorization": "Bearer nope"}).status_code == 200


def test_api_key_from_file(start_daemon, tmp_path):
    key_file = tmp_path / "key.txt"
    key_file.write_text("file-key-42\n")
    d = start_daemon(args=["--api-key-file", str(key_file)])
    assert_401(d.client.get("/v1/models"))
    assert d.client.get("/v1/models",
                        headers={"Authorization": "Bearer file-key-42"}).status_code == 200


def test_no_key_configured_accepts_any_authorization(tiny_daemon):
    r = tiny_daemon.client.get("/v1/models", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 200


def test_request_after_client_error_still_served(tiny_daemon):
    """A garbage request does not poison the connection's daemon: the next
    request on a fresh connection is served."""
    with httpx.Client(base_url=tiny_daemon.url, timeout=HTTP_TIMEOUT) as c:
        assert c.post(GEN, content=b"\xff\xfe{",
                      headers={"Content-Type": "application/json"}).status_code == 400
    assert tiny_daemon.client.post(GEN, json={"prompt": "a red circle"}).status_code == 200


def test_startup_log_names_model_backend_and_pool(tiny_daemon, tiny_info):
    log = tiny_daemon.stderr()
    assert tiny_info["model"] in log
    assert re.search(r"backend cpu \((avx512|avx2|portable) CPU kernels, ", log), log
    # "KV pool 1024.0 MiB of f32 K and V in blocks of 1 tokens: full N images, ..."
    assert re.search(r"KV pool [0-9.]+ MiB of f32 K and V in blocks of [0-9]+ tokens: "
                     r"full [0-9]+ images", log), log


def test_arserve_isa_chooses_the_cpu_kernels(start_daemon):
    """ARSERVE_ISA runs a whole process on the kernels it names (so a suite can run
    the AVX2 ones on an AVX-512 machine); a name the machine cannot run is said,
    and the best kernels are used. Every x86-64 machine that runs arserve's
    AVX2 or AVX-512 kernels runs the portable ones."""
    d = start_daemon(env={"ARSERVE_ISA": "portable"})
    assert "backend cpu (portable CPU kernels, " in d.stderr(), d.stderr()
    assert d.client.post(GEN, json={"prompt": "a red circle"}).status_code == 200
    d = start_daemon(env={"ARSERVE_ISA": "sse9"})
    assert "ARSERVE_ISA=sse9: not one of avx512, avx2, portable that this machine runs; " \
        "using " in d.stderr(), d.stderr()


def test_capacity_line_tells_policies_that_do_not_apply_from_budgets_too_small(tiny_daemon):
    """On a raster model the next-scale policies do not apply at all; a
    raster policy whose default budget cannot hold its prefix and window on
    the tiny grid is "budget too small" (streaming needs 23 of 81 tokens)."""
    cells = capacity_cells(tiny_daemon.stderr())
    for name in ("heatkv", "heatkv_binary", "amskv", "scalekv"):
        assert cells[name] == f"{name} n/a (does not apply to raster models)", cells
    assert cells["streaming"] == "streaming@0.167 n/a (budget too small for this grid)", cells
    for name in ("linear", "headkv"):
        assert "does not apply" not in cells[name], cells


@pytest.mark.parametrize("kv_dtype, stored, per_token", [
    ("auto", "f16", 2), ("bf16", "bf16", 2), ("fp8", "fp8", 1)])
def test_kv_dtype_sets_what_the_pool_stores_and_images_still_come(start_daemon, kv_dtype, stored,
                                                                  per_token):
    """--kv-dtype auto stores the weights' type (the tiny model's f16); each
    type serves images, and the pool holds 4 / per_token times the full-cache
    images an f32 pool of the same size does (up to the floor of the count)."""
    def full_images(log):
        return int(re.search(r"full ([0-9]+) images", log).group(1))
    ref = start_daemon(args=("--kv-pool-mb", "4", "--threads", "1"))
    d = start_daemon(args=("--kv-pool-mb", "4", "--threads", "1", "--kv-dtype", kv_dtype))
    r = d.client.post(GEN, json={"prompt": "a red circle", "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    assert base64.b64decode(r.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
    log = d.stderr()
    assert f"of {stored} K and V" in log, log
    n32, ratio = full_images(ref.stderr()), 4 // per_token
    assert n32 * ratio <= full_images(log) < (n32 + 1) * ratio, (n32, log)
    # The tiny model has no measured fp8 scales: the log says the cache scales by 1.
    assert ("fp8 K and V scales: 1 (the model has no kv_scales.json" in log) == (stored == "fp8"), log


def test_fp8_daemon_takes_the_models_kv_scales(start_daemon, tmp_path):
    """A model directory with kv_scales.json (arserve calibrate --kv-scales):
    an fp8 daemon says it scales per layer and head, and draws a different
    image from the same seed than with scales of 1 (the scales reach the
    cache)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    llm = json.loads((model / "arserve.json").read_text())["llm"]
    heads = llm["num_layers"] * llm.get("num_kv_heads", llm["num_heads"])
    (model / "kv_scales.json").write_text(json.dumps({
        "format": "arserve-kv-scales", "version": 1, "n_layers": llm["num_layers"],
        "n_heads": heads // llm["num_layers"], "prompts": 1,
        "k_amax": [0.05 * (i + 1) for i in range(heads)], "v_amax": [0.04] * heads}))
    body = {"prompt": "a red circle", "response_format": "b64_json", "seed": 4}
    images = []
    for m in (model, TINY_MODEL):
        d = start_daemon(model=str(m), args=("--threads", "1", "--kv-dtype", "fp8"))
        r = d.client.post(GEN, json=body)
        assert r.status_code == 200, r.text
        images.append(r.json()["data"][0]["b64_json"])
        scaled = "fp8 K and V scales: per layer and head, from the model's kv_scales.json"
        assert (scaled in d.stderr()) == (m == model), d.stderr()
    assert images[0] != images[1]
