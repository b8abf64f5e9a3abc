"""`stream: true`: Server-Sent Events with progress, partial images and a
completed event, read raw with httpx and through the openai client.

Progress is checked on the slow model: a tiny-model image can be finished
before the stream's reader first looks, and then the stream has no
progress to report."""
import base64
import json

import openai
import pytest

from conftest import HTTP_TIMEOUT, SLOW_MODEL, Daemon, b64_png_size, model_info

GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def slow_daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("arserve")), SLOW_MODEL, ["--threads", "1"])
    yield d
    d.finish()


@pytest.fixture(scope="module")
def slow_info():
    return model_info(SLOW_MODEL)


def read_sse(daemon, body, headers=None):
    """POSTs body and returns the stream's events as (event, data dict),
    checking the SSE framing on the way."""
    events = []
    with daemon.client.stream("POST", GEN, json=body, headers=headers or {}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        event, data = None, []
        for line in r.iter_lines():
            if line.startswith(":"):
                continue  # a comment (keep-alive)
            if line == "":
                if event is not None or data:
                    assert event, f"data without an event line: {data}"
                    events.append((event, json.loads("\n".join(data))))
                event, data = None, []
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            else:
                pytest.fail(f"unexpected SSE line {line!r}")
        assert event is None and not data, "the stream ended inside an event"
    return events


def test_stream_progress_partials_and_completed(slow_daemon, slow_info):
    body = {"prompt": "a red circle", "seed": 21, "stream": True, "partial_images": 2}
    events = read_sse(slow_daemon, body)
    names = [e for e, _ in events]
    for e, d in events:
        assert d["type"] == e, "each payload carries its event name in 'type'"
    assert set(names) <= {"arserve.progress", "image_generation.partial_image",
                          "image_generation.completed"}, names

    progress = [d for e, d in events if e == "arserve.progress"]
    assert len(progress) >= 3, names
    done = [p["steps_done"] for p in progress]
    assert done == sorted(done) and len(set(done)) == len(done), done
    assert all(p["steps_total"] == slow_info["steps"] for p in progress)
    # The first, once admitted and before any step, says the budget it runs at.
    assert progress[0]["steps_done"] == 0 and progress[0]["kv_cache"] == {"policy": "full"}, \
        progress[0]
    assert all(0 < p["steps_done"] <= slow_info["steps"] for p in progress[1:])
    assert all(p["image_index"] == 0 for p in progress)

    partials = [d for e, d in events if e == "image_generation.partial_image"]
    assert [p["partial_image_index"] for p in partials] == [0, 1], names
    for p in partials:
        assert b64_png_size(p["b64_json"]) == (slow_info["width"], slow_info["height"])
        assert p["size"] == slow_info["size"] and p["output_format"] == "png"
        assert p["image_index"] == 0
    assert partials[0]["b64_json"] != partials[1]["b64_json"]
    # Progress comes before, between and after the partial images.
    first_partial = names.index("image_generation.partial_image")
    assert "arserve.progress" in names[:first_partial], names
    assert "arserve.progress" in names[first_partial + 2:], names

    assert names[-1] == "image_generation.completed", names
    assert names.count("image_generation.completed") == 1
    done_ev = events[-1][1]
    assert b64_png_size(done_ev["b64_json"]) == (slow_info["width"], slow_info["height"])
    assert done_ev["size"] == slow_info["size"]
    assert done_ev["usage"]["output_tokens"] == slow_info["steps"]
    assert done_ev["usage"]["input_tokens"] > 0
    assert done_ev["b64_json"] not in (partials[0]["b64_json"], partials[1]["b64_json"])


def test_streamed_image_is_the_plain_image(tiny_daemon, tiny_info):
    body = {"prompt": "a red circle", "seed": 21, "stream": True, "partial_images": 2}
    events = read_sse(tiny_daemon, body)
    names = [e for e, _ in events]
    partials = [d for e, d in events if e == "image_generation.partial_image"]
    assert [p["partial_image_index"] for p in partials] == [0, 1], names
    for p in partials:
        assert b64_png_size(p["b64_json"]) == (tiny_info["width"], tiny_info["height"])
    assert names[-1] == "image_generation.completed", names
    final = base64.b64decode(events[-1][1]["b64_json"])
    plain = tiny_daemon.client.post(GEN, json={"prompt": "a red circle", "seed": 21},
                                    headers={"Accept": "image/png"})
    assert plain.status_code == 200
    assert plain.content == final


def test_stream_without_partials_has_no_partial_events(tiny_daemon):
    events = read_sse(tiny_daemon, {"prompt": "a blue square", "seed": 2, "stream": True})
    names = [e for e, _ in events]
    assert "image_generation.partial_image" not in names
    assert names[-1] == "image_generation.completed"
    assert names.count("image_generation.completed") == 1


def test_stream_n_2_completes_each_image(tiny_daemon, tiny_info):
    events = read_sse(tiny_daemon, {"prompt": "a blue square", "seed": 3, "n": 2,
                                    "stream": True, "partial_images": 1})
    completed = [d for e, d in events if e == "image_generation.completed"]
    assert sorted(d["image_index"] for d in completed) == [0, 1]
    assert completed[0]["b64_json"] != completed[1]["b64_json"]
    partials = [d for e, d in events if e == "image_generation.partial_image"]
    assert sorted(d["image_index"] for d in partials) == [0, 1]


def test_stream_bad_request_is_a_plain_400(tiny_daemon):
    r = tiny_daemon.client.post(GEN, json={"prompt": "", "stream": True})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "prompt"


def test_openai_client_stream(slow_daemon, slow_info):
    client = openai.OpenAI(base_url=slow_daemon.url + "/v1", api_key="unused",
                           timeout=HTTP_TIMEOUT, max_retries=0)
    stream = client.images.generate(prompt="a red circle", stream=True, partial_images=2,
                                    extra_body={"seed": 21})
    types, partials, completed = [], [], []
    with stream:
        for ev in stream:
            types.append(ev.type)
            if ev.type == "image_generation.partial_image":
                partials.append(ev)
            elif ev.type == "image_generation.completed":
                completed.append(ev)
    assert "arserve.progress" in types  # yielded as a loosely typed event
    assert [p.partial_image_index for p in partials] == [0, 1]
    for p in partials:
        assert b64_png_size(p.b64_json) == (slow_info["width"], slow_info["height"])
    assert len(completed) == 1 and types[-1] == "image_generation.completed"
    c = completed[0]
    assert b64_png_size(c.b64_json) == (slow_info["width"], slow_info["height"])
    assert c.size == slow_info["size"]
    assert c.usage.output_tokens == slow_info["steps"]
