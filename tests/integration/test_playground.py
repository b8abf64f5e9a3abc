"""The playground page GET / serves, driven in headless Chromium (Debian's
chromium and chromium-driver, from selenium) against a loopback daemon
serving the shipped demo models: type a prompt, generate, watch the image
form, compare two KV policies, a wrong API key, a class-conditional
next-scale model, a phone-sized window; and the page's HTTP side (headers,
Host rules, no external assets) with plain requests.

ARSERVE_SCREENSHOT=PATH saves the compare-mode screenshot there (`make
playground-screenshot` writes docs/playground.png, the README's picture);
every run saves its screenshots in the test's temporary folder.
"""
import base64
import io
import json
import math
import os
import re
import shutil
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, SLOW_MODEL, TINY_MODEL, png_size, repo_path, scaled

if REPO not in sys.path:
    sys.path.insert(0, REPO)  # tools.shapes_eval, for the README's picture

# Sanitizer passes skip these: the daemon routes they drive are covered without them.
pytestmark = pytest.mark.clients

SHAPES_MODEL = repo_path("models/shapes")
VAR_MODEL = repo_path(os.environ.get("ARSERVE_VAR_MODEL") or "models/shapes-var")
SHIPPED_MODELS = [repo_path(f"models/{m}") for m in ("shapes", "shapes-var", "shapes-inf")]
INFINITY_MODEL = repo_path("tests/golden/infinity_tiny")  # sizes of several aspect ratios
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
KEY = "playground-test-key"


# ---- the page over plain HTTP ----

def test_page_is_served_self_contained(tiny_daemon):
    # The ready line says where the page is, and that is where it is served.
    with open(tiny_daemon.stdout_path, encoding="utf-8") as f:
        ready = f.read()
    assert f"; the playground: {tiny_daemon.url}/\n" in ready, ready
    r = tiny_daemon.client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp and "img-src data:" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    page = r.text
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    assert '<meta name="viewport"' in page
    # Nothing from elsewhere: no URL with a scheme or a protocol-relative one
    # in an attribute or a fetch.
    assert not re.search(r"""(src|href|action)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"""fetch\(\s*["'`](https?:)?//""", page)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//", page)

    head = tiny_daemon.client.head("/")
    assert head.status_code == 200 and head.content == b""
    post = tiny_daemon.client.post("/", json={})
    assert post.status_code == 405 and post.headers["allow"] == "GET"
    assert post.json()["error"]["code"] == "method_not_allowed"
    assert tiny_daemon.client.get("/index.html").status_code == 404


def test_page_follows_the_api_rules(start_daemon):
    """Public like /health (its API calls carry the key), under the Host
    allow-list like every route."""
    d = start_daemon(TINY_MODEL, env={"ARSERVE_API_KEY": KEY})
    assert d.client.get("/").status_code == 200
    assert d.client.get("/v1/models").status_code == 401
    r = d.client.get("/", headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert "access-control-allow-origin" not in {k.lower() for k in r.headers}


def test_models_card_describes_the_form(tiny_daemon, tiny_info):
    """What the page builds its form from: GET /v1/models' arserve member."""
    m = tiny_daemon.client.get("/v1/models").json()["data"][0]
    a = m["arserve"]
    assert a["family"] == "raster" and a["conditioning"] == "text"
    assert a["negative_prompt"] is False
    assert a["sizes"] == ["%dx%d" % (tiny_info["width"], tiny_info["height"])]
    assert (a["width"], a["height"]) == (tiny_info["width"], tiny_info["height"])
    assert a["steps"] == tiny_info["steps"] and a["step_unit"] == "token"
    assert a["segment_name"] == "line" and sum(a["segment_tokens"]) == tiny_info["steps"]
    assert a["limits"]["max_partial_images"] == 3 and a["limits"]["max_n"] >= 1
    names = [p["name"] for p in a["kv_policies"]]
    assert names[0] == "full" and a["kv_policy"] == "full"
    assert "linear" in names and "amskv" not in names and "heatkv" not in names
    for p in a["kv_policies"]:
        if p["name"] == "full":
            assert "budget" not in p
            continue
        assert 0 < p["min_budget"] <= 1 and 0 < p["budget"] <= 1
        # The least budget of the shortest prompt (one token) is the edge: it
        # is admitted, a hair less is refused.
        ok = tiny_daemon.client.post("/v1/images/generations", json={
            "prompt": "red", "kv_policy": p["name"], "kv_budget": p["min_budget"]})
        assert ok.status_code == 200, (p, ok.text)
        below = p["min_budget"] - 1e-4
        if below > 0:
            bad = tiny_daemon.client.post("/v1/images/generations", json={
                "prompt": "red", "kv_policy": p["name"], "kv_budget": below})
            assert bad.status_code == 400, (p, bad.text)
            # kv_budget, or a knob the smaller budget cannot hold
            assert bad.json()["error"]["code"] == "invalid_value"


def test_streamed_completion_reports_kv_and_timings(tiny_daemon, tiny_info):
    """The page shows the KV bytes held beside the planner's and the steps:
    the completed event carries them, as a non-streamed answer does."""
    body = {"prompt": "a blue square", "stream": True, "seed": 3, "kv_policy": "linear",
            "kv_budget": 0.5}
    with tiny_daemon.client.stream("POST", "/v1/images/generations", json=body) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    events = [f for f in text.split("\n\n") if f.startswith("event: image_generation.completed")]
    assert len(events) == 1
    data = "\n".join(line[6:] for line in events[0].splitlines() if line.startswith("data: "))
    done = json.loads(data)
    kv, t = done["kv_cache"], done["timings"]
    assert kv["policy"] == "linear" and kv["budget"] == 0.5
    assert 0 < kv["peak_bytes"] <= kv["planned_peak_bytes"]
    assert t["steps"] == tiny_info["steps"] and t["run_s"] > 0 and t["queue_s"] >= 0


def test_next_scale_card(start_daemon):
    d = start_daemon(VAR_MODEL)
    m = d.client.get("/v1/models").json()["data"][0]
    a = m["arserve"]
    assert a["family"] == "scale" and a["conditioning"] == "class"
    assert a["step_unit"] == "segment" and a["segment_name"] == "scale"
    assert a["steps"] == len(a["segment_tokens"]) and m["num_classes"] == len(m["classes"])
    names = [p["name"] for p in a["kv_policies"]]
    assert "amskv" in names and "heatkv" in names and "linear" not in names


# ---- the page in a browser ----

@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    for path, pkg in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            pytest.fail(f"{path} is missing: `make deps` installs Debian's {pkg}")
    os.environ["SE_OFFLINE"] = "true"  # never let selenium fetch a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,900", "--no-first-run", "--disable-extensions",
                "--force-device-scale-factor=1",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        opts.add_argument(arg)
    service = Service(executable_path=CHROMEDRIVER,
                      log_output=str(tmp_path_factory.mktemp("chromedriver") / "driver.log"))
    drv = webdriver.Chrome(options=opts, service=service)
    drv.set_page_load_timeout(scaled(30))
    yield drv
    drv.quit()


def wait_for(drv, js, timeout, what):
    """Polls a JavaScript expression until it is truthy; its value."""
    from selenium.webdriver.support.ui import WebDriverWait
    try:
        return WebDriverWait(drv, timeout, poll_frequency=0.1).until(
            lambda d: d.execute_script("return " + js))
    except Exception:
        err = drv.execute_script("return document.getElementById('error').textContent")
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (page error: {err!r})")


def open_page(drv, daemon, key=None):
    """The page, fresh, with this tab's session storage set to key."""
    drv.get(daemon.url + "/")
    drv.execute_script("sessionStorage.clear()" if key is None else
                       f"sessionStorage.setItem('arserve-api-key', {key!r})")
    drv.get(daemon.url + "/")


def final_png(drv, slot):
    src = drv.execute_script(f"return document.getElementById('image-{slot}').src")
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:40]
    return base64.b64decode(src[len(prefix):], validate=True)


def api_png(daemon, body):
    """The PNG the API answers body with (not streamed)."""
    r = daemon.client.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def rgb(png):
    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.float64)


def text(drv, id_):
    return drv.execute_script(f"return document.getElementById('{id_}').textContent")


def shoot(drv, tmp_path, name):
    path = tmp_path / f"{name}.png"
    drv.save_screenshot(str(path))
    assert png_size(path.read_bytes())[0] > 0
    return path


def test_generate_in_the_browser(browser, start_daemon, tmp_path):
    """Type a prompt, press Enter, watch the progress and previews, get a PNG
    of the model's size with the steps and KV figures beside it."""
    from selenium.webdriver.common.keys import Keys
    d = start_daemon(SHAPES_MODEL)
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    open_page(browser, d)
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    assert "shapes" in text(browser, "model")
    prompt = browser.find_element("id", "prompt")
    assert browser.switch_to.active_element == prompt  # ready to type
    # One size and no negative prompt: neither control is offered.
    assert not browser.find_element("id", "negative").is_displayed()
    assert not browser.find_element("id", "size").is_displayed()
    prompt.send_keys("a red circle on the left")
    prompt.send_keys(Keys.ENTER)
    wait_for(browser, "document.getElementById('image-a').dataset.final", scaled(90),
             "the final image")
    png = final_png(browser, "a")
    assert png_size(png) == (card["width"], card["height"])
    assert browser.execute_script("return document.getElementById('image-a').naturalWidth") \
        == card["width"]
    # What the form sent: the same request through the API gives the same bytes.
    assert png == api_png(d, {"prompt": "a red circle on the left", "seed": 1,
                              "guidance_scale": card["sampling"]["guidance_scale"]})
    previews = int(browser.execute_script(
        "return document.getElementById('image-a').dataset.previews"))
    assert previews == card["limits"]["max_partial_images"]
    lines, steps = len(card["segment_tokens"]), card["steps"]
    assert text(browser, "status-a") == f"line {lines} of {lines} · step {steps} of {steps} · done"
    assert browser.execute_script("return document.getElementById('progress-a').value") == 1
    stats = text(browser, "stats-a")
    assert f"steps{card['steps']}" in stats and "KV held" in stats and "KV planned" in stats
    dl = browser.find_element("id", "stats-a")
    peak, planned = int(dl.get_attribute("data-peak")), int(dl.get_attribute("data-planned"))
    assert 0 < peak <= planned
    assert text(browser, "error") == ""
    # The metrics panel has polled the server.
    wait_for(browser, "/ of /.test(document.getElementById('m-kv-text').textContent)",
             scaled(10), "the KV pool figure")
    assert re.fullmatch(r"[0-9.]+ [KMG]iB of [0-9.]+ [KMG]iB \([0-9.]+%\)",
                        text(browser, "m-kv-text")), text(browser, "m-kv-text")
    assert text(browser, "m-running").isdigit() and text(browser, "m-waiting").isdigit()
    shoot(browser, tmp_path, "generate")


@pytest.mark.parametrize("model", SHIPPED_MODELS, ids=os.path.basename)
def test_every_policy_the_card_lists_generates_at_its_default_budget(browser, start_daemon, model):
    """Each policy the form offers on each shipped model, at the budget the form
    fills in, is a valid form (a budget the field's own min and step made
    invalid blocked Generate with only a browser tooltip) and draws an image
    that policy made."""
    d = start_daemon(model)
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    open_page(browser, d)
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    offered = browser.execute_script(
        "return [...document.getElementById('policy').options].map(o => o.value)")
    assert offered == [p["name"] for p in card["kv_policies"]], offered
    assert len(offered) > 1, offered
    if browser.find_element("id", "prompt").is_displayed():
        browser.find_element("id", "prompt").send_keys("a red circle")
    for policy in offered:
        browser.execute_script(
            "const s = document.getElementById('policy'); s.value = arguments[0];"
            "s.dispatchEvent(new Event('change'));", policy)
        budget = browser.execute_script("return document.getElementById('budget').value")
        valid = browser.execute_script("return document.getElementById('form').checkValidity()")
        assert valid, f"{policy}: the form is invalid with the budget it filled in ({budget})"
        browser.execute_script("document.getElementById('image-a').dataset.final = ''")
        browser.find_element("id", "generate").click()
        wait_for(browser, "document.getElementById('image-a').dataset.final", scaled(90),
                 f"{policy}'s image")
        assert text(browser, "error") == "", (policy, text(browser, "error"))
        assert text(browser, "caption-a").startswith(policy), (policy, text(browser, "caption-a"))


# The README's picture of the page (docs/playground.png): a prompt and seed of its table of
# the demo models, which the model draws right, under full and linear.
COMPARE_PROMPT, COMPARE_BUDGET = "two green triangles", "0.5"


def readme_caption(picture):
    """The README's paragraph after the image `picture`, on one line."""
    with open(repo_path("README.md"), encoding="utf-8") as f:
        text = f.read()
    at = text.index("](%s)" % picture)
    para = text[at:].split("\n\n")[1]
    return " ".join(para.split())


def kv_held(drv, slot):
    return drv.execute_script(
        "const dts = [...document.getElementById(arguments[0]).querySelectorAll('dt')];"
        "const dt = dts.find(d => d.textContent === 'KV held');"
        "return dt ? dt.nextElementSibling.textContent : null;", "stats-" + slot)


def test_compare_mode_shows_two_images_and_their_psnr(browser, start_daemon, tmp_path):
    """Compare mode, and the README's picture of it: the full image is the table's seed-1
    picture of the same prompt, ShapesEval scores it right, and the caption under the
    picture gives the prompt, the seed, the budget, the PSNR and the KV figures the page
    shows."""
    from selenium.webdriver.support.ui import Select
    from tools.shapes_eval import examples, scorer
    from tools.shapes_eval.make_expected import ENV
    # OpenBLAS as the README's table draws it (make_expected's ENV: one kernel on every
    # x86-64): another core type's sums can move a token, and the picture is the table's only
    # if its tokens are.
    d = start_daemon(SHAPES_MODEL, env=ENV)
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    open_page(browser, d)
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    browser.find_element("id", "prompt").send_keys(COMPARE_PROMPT)
    seed = browser.find_element("id", "seed").get_attribute("value")
    Select(browser.find_element("id", "policy")).select_by_value("linear")
    linear = next(p for p in card["kv_policies"] if p["name"] == "linear")
    budget = browser.find_element("id", "budget")
    assert float(budget.get_attribute("value")) == max(linear["budget"], linear["min_budget"])
    assert float(budget.get_attribute("min")) == linear["min_budget"]
    budget.clear()
    budget.send_keys(COMPARE_BUDGET)
    browser.find_element("id", "compare").click()
    browser.find_element("id", "generate").click()
    wait_for(browser, "!document.getElementById('psnr').hidden", scaled(120), "the PSNR")
    a, b = final_png(browser, "a"), final_png(browser, "b")
    assert png_size(a) == png_size(b) == (card["width"], card["height"])
    # Each caption says the budget the server admitted the request at.
    assert text(browser, "caption-a") == "full"
    assert text(browser, "caption-b") == "linear at budget " + COMPARE_BUDGET
    shown = float(browser.find_element("id", "psnr").get_attribute("data-db"))
    mse = np.mean((rgb(a) - rgb(b)) ** 2)
    want = math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)
    assert shown == pytest.approx(want, abs=1e-6) or (shown == want == math.inf)
    assert "PSNR linear vs full" in text(browser, "psnr")
    # The picture draws what its prompt says (ShapesEval scores it right), and it is the
    # README table's seed-1 picture of that prompt.
    ok, why, _ = scorer.score_image(rgb(a).astype(np.uint8), examples.spec_for(COMPARE_PROMPT)[1])
    assert ok, f"ShapesEval scores full's image of {COMPARE_PROMPT!r} at seed {seed} wrong: {why}"
    ex = next((e for e in examples.EXAMPLES
               if e.model == "models/shapes" and e.condition == COMPARE_PROMPT), None)
    assert ex is not None, f"{COMPARE_PROMPT!r} is no row of the README's table on models/shapes"
    assert seed == "1", seed
    with open(repo_path(ex.png), "rb") as f:
        assert a == f.read(), f"full's image is not {ex.png}, the table's seed-1 picture"
    # The README's caption tells what the picture shows.
    caption = readme_caption("docs/playground.png")
    db = re.search(r": (\S+) dB", text(browser, "psnr")).group(1)
    held_a, held_b = kv_held(browser, "a"), kv_held(browser, "b")
    for part in (f'"{COMPARE_PROMPT}" at seed {seed}', f"linear` at budget {COMPARE_BUDGET}",
                 f"PSNR {db} dB", f"{held_b} of KV where full holds {held_a}"):
        assert part in caption, f"the README's caption under the picture lacks {part!r}: {caption}"
    assert ("the same image" in caption) == (want == math.inf), caption
    browser.set_window_size(1000, 1150)  # the whole result in the picture
    try:
        path = shoot(browser, tmp_path, "compare")
    finally:
        browser.set_window_size(1100, 900)
    out = os.environ.get("ARSERVE_SCREENSHOT")
    if out:
        shutil.copyfile(path, out)


def test_budget_range_shows_the_budget_it_got(browser, start_daemon):
    """A budget range from the form: the caption (from the stream's first
    progress event) and the figures say the budget the request ran at, the
    range's top on an idle server, and the range."""
    from selenium.webdriver.support.ui import Select
    d = start_daemon(SHAPES_MODEL)
    open_page(browser, d)
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    browser.find_element("id", "prompt").send_keys("a red circle")
    Select(browser.find_element("id", "policy")).select_by_value("linear")
    budget, low = browser.find_element("id", "budget"), browser.find_element("id", "budget-min")
    assert low.is_enabled() and low.get_attribute("value") == ""
    budget.clear()
    budget.send_keys("1")
    low.send_keys("0.5")
    browser.find_element("id", "generate").click()
    wait_for(browser, "document.getElementById('image-a').dataset.final", scaled(90),
             "the final image")
    assert text(browser, "caption-a") == "linear at budget 1"
    assert "KV budget1 (range 0.5–1)" in text(browser, "stats-a"), text(browser, "stats-a")
    assert browser.find_element("id", "stats-a").get_attribute("data-budget") == "1"
    # full takes no budget: no range either.
    Select(browser.find_element("id", "policy")).select_by_value("full")
    assert not low.is_enabled()


def test_wrong_api_key_shows_the_servers_message(browser, start_daemon):
    d = start_daemon(SHAPES_MODEL, env={"ARSERVE_API_KEY": KEY})
    expected = d.client.get("/v1/models").json()["error"]["message"]
    open_page(browser, d)
    wait_for(browser, "document.getElementById('error').textContent", scaled(15), "an error")
    assert text(browser, "error") == expected
    assert browser.execute_script("return document.getElementById('key-panel').open")
    assert browser.execute_script("return document.getElementById('form').hidden")

    key_box = browser.find_element("id", "api-key")
    key_box.send_keys("not-the-key\n")
    wait_for(browser, "document.getElementById('key-panel').open", scaled(15),
             "the key panel again")
    assert text(browser, "error") == expected
    assert browser.execute_script("return sessionStorage.getItem('arserve-api-key')") \
        == "not-the-key"

    key_box.clear()
    key_box.send_keys(KEY + "\n")
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    assert text(browser, "error") == ""
    # Kept for the tab: a reload needs no key.
    browser.refresh()
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form again")
    # A key that goes wrong later: the generation shows the server's message.
    browser.execute_script("sessionStorage.setItem('arserve-api-key', 'wrong')")
    browser.find_element("id", "prompt").send_keys("a red circle")
    browser.find_element("id", "generate").click()
    wait_for(browser, "document.getElementById('error').textContent", scaled(15), "an error")
    assert text(browser, "error") == expected


def test_class_picker_on_a_next_scale_model(browser, start_daemon):
    from selenium.webdriver.support.ui import Select
    d = start_daemon(VAR_MODEL)
    m = d.client.get("/v1/models").json()["data"][0]
    card = m["arserve"]
    open_page(browser, d)
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    assert not browser.find_element("id", "prompt").is_displayed()
    picker = Select(browser.find_element("id", "class"))
    assert len(picker.options) == m["num_classes"]
    assert picker.options[1].text == f"1: {m['classes'][1]}"
    picker.select_by_value("1")
    Select(browser.find_element("id", "policy")).select_by_value("amskv")
    browser.find_element("id", "generate").click()
    wait_for(browser, "document.getElementById('image-a').dataset.final", scaled(120),
             "the final image")
    png = final_png(browser, "a")
    assert png_size(png) == (card["width"], card["height"])
    assert png == api_png(d, {"class_label": 1, "seed": 1, "kv_policy": "amskv"})
    assert png != api_png(d, {"class_label": 0, "seed": 1, "kv_policy": "amskv"})
    n = len(card["segment_tokens"])
    assert text(browser, "status-a") == f"scale {n} of {n} · step {n} of {n} · done"
    assert f"steps{card['steps']}" in text(browser, "stats-a")


def test_size_and_negative_prompt_on_an_infinity_model(browser, start_daemon):
    """A text-to-image next-scale model with sizes of several aspect ratios and a
    negative prompt: the page offers both, and sends what was picked."""
    from selenium.webdriver.support.ui import Select
    d = start_daemon(INFINITY_MODEL)
    card = d.client.get("/v1/models").json()["data"][0]["arserve"]
    assert card["negative_prompt"] is True and len(card["sizes"]) > 1
    open_page(browser, d)
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    assert browser.find_element("id", "negative").is_displayed()
    picker = Select(browser.find_element("id", "size"))
    assert [o.get_attribute("value") for o in picker.options] == card["sizes"]
    wide = max(card["sizes"], key=lambda z: int(z.split("x")[0]) / int(z.split("x")[1]))
    w, h = map(int, wide.split("x"))
    picker.select_by_value(wide)
    g = math.gcd(w, h)
    assert picker.first_selected_option.text == f"{wide} ({w // g}:{h // g})"
    browser.find_element("id", "prompt").send_keys("a dog")
    browser.find_element("id", "negative").send_keys("dark blurry")
    browser.find_element("id", "generate").click()
    wait_for(browser, "document.getElementById('image-a').dataset.final", scaled(120),
             "the final image")
    png = final_png(browser, "a")
    assert png_size(png) == (w, h)
    box = browser.execute_script(
        "const r = document.getElementById('image-a').getBoundingClientRect();"
        "return [r.width, r.height]")
    assert box[0] / box[1] == pytest.approx(w / h, rel=0.03), box  # the frame takes its shape
    body = {"prompt": "a dog", "seed": 1, "size": wide,
            "guidance_scale": card["sampling"]["guidance_scale"]}
    assert png == api_png(d, dict(body, negative_prompt="dark blurry"))
    assert png != api_png(d, body)
    n = len(card["segment_tokens"])  # every size of Infinity's schedules has as many scales
    assert text(browser, "status-a") == f"scale {n} of {n} · step {n} of {n} · done"


def test_readable_on_a_phone(browser, start_daemon, tmp_path):
    d = start_daemon(TINY_MODEL)
    browser.set_window_size(390, 844)
    try:
        open_page(browser, d)
        wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"{overflow} px wider than the screen"
        for id_ in ("generate", "stop", "seed-random"):
            clipped = browser.execute_script(
                f"const e = document.getElementById('{id_}'); return e.scrollWidth - e.clientWidth")
            assert clipped <= 0, f"#{id_} is cut by {clipped} px"
        font = browser.execute_script(
            "return parseFloat(getComputedStyle(document.getElementById('prompt')).fontSize)")
        assert font >= 14
        shoot(browser, tmp_path, "phone")
    finally:
        browser.set_window_size(1100, 900)


def test_escape_stops_a_generation(browser, start_daemon):
    """Esc aborts the stream; the daemon sees the client go and cancels."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys
    d = start_daemon(SLOW_MODEL)
    open_page(browser, d)
    wait_for(browser, "!document.getElementById('form').hidden", scaled(15), "the form")
    browser.find_element("id", "prompt").send_keys("a red circle\n")
    wait_for(browser, "document.getElementById('progress-a').value > 0", scaled(30),
             "the first progress")
    ActionChains(browser).send_keys(Keys.ESCAPE).perform()
    wait_for(browser, "document.getElementById('error').textContent === 'stopped'",
             scaled(10), "the stop")
    assert not browser.execute_script("return document.getElementById('generate').disabled")
    d.wait_metrics(lambda m: m.get("arserve_requests_cancelled_total") >= 1, timeout=15,
                   what="the cancellation")
