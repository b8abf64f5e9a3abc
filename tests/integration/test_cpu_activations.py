"""serve --cpu-activations bf16: a model with bf16 weights serves in that mode and the start-up
log says how it multiplies (on AMX tiles or not); on a model whose weights are not bf16 the log
warns that the setting changes nothing, and the model still serves."""
import re

from conftest import TINY_MODEL, repo_path

BF16_MODEL = repo_path("tests/golden/janus_tiny_bf16")


def test_bf16_model_serves_and_the_log_says_how(start_daemon):
    d = start_daemon(BF16_MODEL, args=["--cpu-activations", "bf16"])
    assert re.search(r"info +cpu_activations bf16: activations rounded to bf16, (the products on "
                     r"this CPU's AMX tiles|but this CPU has no AMX)", d.stderr()), d.stderr()
    r = d.client.post("/v1/images/generations", json={"prompt": "a red circle"})
    assert r.status_code == 200, r.text


def test_weights_not_bf16_are_warned_of(start_daemon):
    d = start_daemon(TINY_MODEL, args=["--cpu-activations", "bf16"])  # F16 weights
    assert re.search(r"warn +cpu_activations bf16 changes nothing here: the model's weights are "
                     r"(F16|F32)", d.stderr()), d.stderr()
    r = d.client.post("/v1/images/generations", json={"prompt": "a red circle"})
    assert r.status_code == 200, r.text
