"""Continuous batching seen from outside: many concurrent requests all
complete, and the engine stepped more than one image per iteration."""
import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import HTTP_TIMEOUT, png_size

GEN = "/v1/images/generations"
N_CLIENTS = 32


@pytest.mark.timeout(120)
def test_32_concurrent_requests_complete_and_share_iterations(tiny_daemon, tiny_info):
    before = tiny_daemon.metrics()

    def one(i):
        # A client per thread: 32 connections at once, not a shared pool.
        with httpx.Client(base_url=tiny_daemon.url, timeout=HTTP_TIMEOUT) as c:
            return c.post(GEN, json={"prompt": "a red circle on the left", "seed": 1000 + i})

    with ThreadPoolExecutor(N_CLIENTS) as pool:
        responses = list(pool.map(one, range(N_CLIENTS), timeout=2 * HTTP_TIMEOUT))

    assert [r.status_code for r in responses] == [200] * N_CLIENTS, \
        [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200]
    pngs = [base64.b64decode(r.json()["data"][0]["b64_json"]) for r in responses]
    for png in pngs:
        assert png_size(png) == (tiny_info["width"], tiny_info["height"])
    assert len(set(pngs)) == N_CLIENTS, "different seeds gave identical images"

    # Counters can trail the responses by a moment (the PNG worker counts an
    # image after waking the request's thread), so wait for them.
    ok_before = before.get("arserve_images_total", status="ok")
    after = tiny_daemon.wait_metrics(
        lambda m: m.get("arserve_images_total", status="ok") - ok_before >= N_CLIENTS
        and m.get("arserve_kv_pool_reserved_bytes") == 0,
        timeout=5, what=f"{N_CLIENTS} images counted ok and the KV pool idle")
    assert after.get("arserve_images_total", status="ok") - ok_before == N_CLIENTS
    assert after.get("arserve_image_tokens_generated_total") - \
        before.get("arserve_image_tokens_generated_total") == N_CLIENTS * tiny_info["steps"]
    # Sequences per iteration: 2 per image (its CFG pair). Iterations with
    # more than 2 advanced more than one image at once.
    batched = after.histogram_above("arserve_iteration_sequences", 2) - \
        before.histogram_above("arserve_iteration_sequences", 2)
    assert batched > 0, "no iteration advanced more than one image:\n" + after.text
    # Batching means fewer iterations than images x steps.
    iterations = after.get("arserve_iterations_total") - before.get("arserve_iterations_total")
    assert iterations < N_CLIENTS * tiny_info["steps"]
    # And everything is back to idle.
    assert after.get("arserve_requests_running") == 0
    assert after.get("arserve_requests_waiting") == 0
    assert after.get("arserve_kv_pool_reserved_bytes") == 0

    # Seeded output does not depend on what else shared the batch: the same
    # requests made one at a time give the same bytes.
    for i in (0, N_CLIENTS // 2, N_CLIENTS - 1):
        alone = tiny_daemon.client.post(GEN, json={"prompt": "a red circle on the left",
                                                   "seed": 1000 + i},
                                        headers={"Accept": "image/png"})
        assert alone.status_code == 200
        assert alone.content == pngs[i], f"request {i}: batched image differs from alone"

