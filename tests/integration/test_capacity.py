"""GET /v1/capacity and the cost table the daemon learns from its own iterations: a
conservative default (or --cost-table's) until the engine has timed enough iterations, then
a table fitted from them, the same figures in /metrics, in the form `arserve bench
--profile` writes and `--cost-table` and `arserve simulate --costs` read."""
import json
import math
import subprocess

from conftest import ARSERVE_BIN, TINY_MODEL, clean_env, scaled

GEN = "/v1/images/generations"
TERMS = ("intercept_s", "per_sequence_s", "per_kv_attended_s", "per_new_token_s", "per_kv_scored_s")
METRIC_TERMS = ("intercept", "per_sequence", "per_kv_attended", "per_new_token", "per_kv_scored")


def capacity(d):
    r = d.client.get("/v1/capacity")
    assert r.status_code == 200, r.text
    return r.json()


def test_the_daemon_learns_its_cost_and_says_it(start_daemon, tiny_info, tmp_path):
    d = start_daemon()
    c = capacity(d)
    assert c["object"] == "capacity"
    t, learn = c["cost_table"], c["learning"]
    assert t["source"].startswith("default:"), t
    assert learn["timed_iterations"] == 0 and learn["refits"] == 0 and t["fit"]["samples"] == 0
    assert learn["refit_every"] == 64 and learn["window_iterations"] == 4096
    assert t["step"]["per_new_token_s"] > 0 and t["decode_s_per_image"] == 1
    assert c["kv_pool"]["capacity_bytes"] > 0

    # Enough images for a refit: every step of every image is an iteration timed.
    images = 0
    while capacity(d)["learning"]["refits"] == 0:
        assert images < 64 * 4, "64 iterations timed and still no fit"
        r = d.client.post(GEN, json={"prompt": "a red circle", "n": 2, "seed": images})
        assert r.status_code == 200, r.text
        images += 2
    c = capacity(d)
    t, learn = c["cost_table"], c["learning"]
    assert learn["timed_iterations"] >= 64 and learn["refits"] >= 1
    assert t["source"].startswith("learned from the engine's last "), t["source"]
    # Fitted from the ring at the last refit (64 iterations or more) less the outliers.
    window = t["fit"]["samples"] + learn["outliers_left_out"]
    assert 64 <= window <= learn["timed_iterations"], (t, learn)
    assert f"last {window} iterations ({learn['outliers_left_out']} left out" in t["source"]
    steps = [t["step"][k] for k in TERMS]
    assert all(v >= 0 and math.isfinite(v) for v in steps) and any(v > 0 for v in steps), t
    assert 0 <= t["fit"]["rel_rms"] and math.isfinite(t["fit"]["rel_rms"])
    # The per-image costs are the images' own (not the default's 1 s).
    assert 0 < t["decode_s_per_image"] != 1 and 0 < t["png_s_per_image"] != 1
    # Each answered request's time on its HTTP thread, outside the engine.
    assert 0 < t["http_s_per_request"] < 1, t

    m = d.metrics()
    for key, term in zip(TERMS, METRIC_TERMS):
        assert math.isclose(m.get("arserve_cost_step_seconds", -1, term=term), t["step"][key],
                            rel_tol=1e-6, abs_tol=1e-15), (term, m.text)
    assert m.get("arserve_cost_fit_samples") == t["fit"]["samples"]
    assert m.get("arserve_cost_refits_total") == learn["refits"]
    assert math.isclose(m.get("arserve_cost_image_seconds", part="png"), t["png_s_per_image"],
                        rel_tol=1e-6)
    assert math.isclose(m.get("arserve_cost_http_seconds"), t["http_s_per_request"], rel_tol=1e-6)

    # The learned table is a cost table file: a daemon started from it answers with it
    # until it learns its own, and the simulator prices a run with it.
    path = tmp_path / "learned.json"
    path.write_text(json.dumps(t))
    d2 = start_daemon(args=["--cost-table", str(path)])
    seeded = capacity(d2)["cost_table"]
    assert seeded["source"] == t["source"] and seeded["step"] == t["step"], seeded
    mix = tmp_path / "mix.jsonl"
    mix.write_text(json.dumps({"prompt": "a red circle"}) + "\n")
    p = subprocess.run([ARSERVE_BIN, "simulate", "--model", TINY_MODEL, "--costs", str(path),
                        "--mix", str(mix), "--rates", "1", "-n", "4", "--out",
                        str(tmp_path / "sim")], capture_output=True, text=True,
                       env=clean_env(), timeout=scaled(60))
    assert p.returncode == 0, p.stdout + p.stderr


def test_cost_table_flag_refuses_a_bad_file(tmp_path):
    def serve(path):
        return subprocess.run([ARSERVE_BIN, "serve", "--model", TINY_MODEL, "--port", "0",
                               "--cost-table", str(path)], capture_output=True, text=True,
                              env=clean_env(), timeout=scaled(60))

    p = serve(tmp_path / "missing.json")
    assert p.returncode == 2 and f"--cost-table: {tmp_path}/missing.json: cannot open" in \
        p.stderr, p.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"family": "raster", "step": {"intercept_s": -1}}')
    p = serve(bad)
    assert p.returncode == 2 and f'{bad}: "intercept_s" must be a number >= 0' in p.stderr, \
        p.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"family": "scale", "source": "x", "step": dict.fromkeys(TERMS, 0),
                                 "decode_s_per_image": 0, "png_s_per_image": 0}))
    p = serve(other)
    assert p.returncode == 2 and "a table of the scale family, and the model is of the raster" \
        in p.stderr, p.stderr


def test_capacity_is_get_only_and_keyed(start_daemon, tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    d = start_daemon(args=["--api-key-file", str(key)])
    assert d.client.get("/v1/capacity").status_code == 401
    r = d.client.get("/v1/capacity", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["object"] == "capacity"
    r = d.client.post("/v1/capacity", headers={"Authorization": "Bearer s3cret"}, json={})
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def pinned_table(tmp_path, **step):
    """A cost table file for the tiny model (raster), every term 0 but those given."""
    t = {"family": "raster", "source": "a test's", "step": dict.fromkeys(TERMS, 0.0),
         "decode_s_per_image": 0.001, "png_s_per_image": 0.001}
    t["step"].update(step)
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(t))
    return str(path)


def test_objectives_refuse_what_cannot_be_kept_and_compress_to_keep_them(start_daemon, tmp_path):
    """With a pinned table (cost_learning off: the predictions are the table's, not this
    machine's), a request's deadline_ms decides: refused at once when it could not be kept
    even alone, admitted with its predicted time when it can, and an elastic range admitted
    at a lower budget when only that keeps it (admission "time")."""
    table = pinned_table(tmp_path, intercept_s=0.01, per_kv_attended_s=2e-5)
    d = start_daemon(args=["--cost-table", table, "--cost-learning", "off"])

    r = d.client.post(GEN, json={"prompt": "a red circle", "deadline_ms": 1})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "objective_unreachable" and "even alone" in err["message"], err

    def run(**body):
        r = d.client.post(GEN, json={"prompt": "a red circle", "seed": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["kv_cache"]

    top = run(kv_policy="linear", kv_budget=1, deadline_ms=600000)
    floor = run(kv_policy="linear", kv_budget=0.5, deadline_ms=600000)
    assert top["admission"] == "free" and floor["admission"] == "free"
    assert 0.64 < floor["predicted_s"] < top["predicted_s"], (top, floor)
    between = (top["predicted_s"] + floor["predicted_s"]) / 2
    kv = run(kv_policy="linear", kv_budget=1, kv_budget_min=0.5,
             deadline_ms=int(between * 1000))
    assert kv["admission"] == "time" and kv["budget"] < 1, kv
    assert floor["predicted_s"] <= kv["predicted_s"] <= between, (kv, between)
    m = d.metrics()
    assert m.get("arserve_admissions_total", regime="time") == 1
    assert m.get("arserve_admissions_total", regime="free") == 2
    assert m.get("arserve_admissions_refused_total", reason="objective") == 1


def test_the_daemons_objective_and_no_table(start_daemon, tmp_path):
    """--slo-p99-ms is every request's objective unless it gives deadline_ms. Before the
    engine has a table (none given, nothing fitted yet) admission does not price time: the
    first request is admitted whatever its objective, and says no predicted time."""
    d = start_daemon(args=["--slo-p99-ms", "1"])
    r = d.client.post(GEN, json={"prompt": "a red circle"})
    assert r.status_code == 200, r.text
    kv = r.json()["kv_cache"]
    assert kv["admission"] == "free" and "predicted_s" not in kv, kv
    table = pinned_table(tmp_path, intercept_s=0.01)
    d2 = start_daemon(args=["--slo-p99-ms", "1", "--cost-table", table,
                            "--cost-learning", "off"])
    r = d2.client.post(GEN, json={"prompt": "a red circle"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "objective_unreachable"
    r = d2.client.post(GEN, json={"prompt": "a red circle", "deadline_ms": 60000})
    assert r.status_code == 200 and r.json()["kv_cache"]["predicted_s"] > 0.64, r.text
