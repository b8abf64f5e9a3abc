"""Load test of arserve's image generation with locust.

    locust -f deploy/loadtest/locustfile.py --headless -u 4 -r 2 -t 30s --host http://127.0.0.1:8080

Each simulated user posts to /v1/images/generations in a loop. A request is
counted failed unless it answers 200 with images; a failure is named by its
status and the error.code of the JSON body ("429 queue_full" when the waiting
queue is full, "503 server_draining" while the daemon drains), so locust's
failure table says why. Requests are named by KV policy and budget, so
locust's statistics show each policy on its own line.

What to change:
  LOADTEST_MIX=FILE   a JSONL file, one request body a line, e.g.
                              {"prompt": "a red circle", "kv_policy": "linear", "kv_budget": 0.25}
                              each user picks a line at random for every request
                              (repeat a line to send it more often); set it
                              for locust only, not exported: the daemon refuses
                              ARSERVE_* variables it does not know
  ARSERVE_API_KEY             sent as 'Authorization: Bearer KEY' when set
  PROMPTS, wait_time below    the prompts used without a mix file; the pause
                              between a user's requests
"""
import json
import os
import random

from locust import HttpUser, constant, task

PATH = "/v1/images/generations"

# Prompts sent (with the daemon's default KV policy) when no mix file is given.
PROMPTS = [
    "a red circle on the left",
    "two green triangles",
    "a blue square above a yellow diamond",
]


def load_mix():
    path = os.environ.get("LOADTEST_MIX")
    if not path:
        return [{"prompt": p} for p in PROMPTS]
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


MIX = load_mix()


def request_name(body):
    """The name locust groups a request's statistics under: its policy and budget."""
    policy = body.get("kv_policy", "default")
    budget = body.get("kv_budget")
    return f"{PATH} [{policy}]" if budget is None else f"{PATH} [{policy} {budget}]"


class ImageUser(HttpUser):
    host = "http://127.0.0.1:8080"  # locust's --host replaces it
    # Closed loop: a user sends its next request as soon as the last one is
    # answered; between(1, 5) would add 1 to 5 s of think time.
    wait_time = constant(0)

    def on_start(self):
        key = os.environ.get("ARSERVE_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    @task
    def generate(self):
        body = random.choice(MIX)
        with self.client.post(PATH, json=body, name=request_name(body),
                              catch_response=True) as r:
            if r.status_code == 0:  # no answer: locust records the connection error
                return
            if r.status_code == 200:
                if not r.json().get("data"):
                    r.failure("200 without data")
                return
            try:
                code = r.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "no error body"
            r.failure(f"{r.status_code} {code}")
