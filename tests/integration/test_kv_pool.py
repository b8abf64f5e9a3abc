"""--kv-pool-mb auto (the default) sizes the KV pool from the machine: on the
CPU, --kv-pool-share of the RAM available once the model is loaded, at most
what --max-running full-cache images of the default size need; the start-up
log says which and why. A size given in MiB is taken as given."""
import re

import pytest

from conftest import capacity_cells, full_image_kv_bytes, repo_path

SHAPES = repo_path("models/shapes")
AUTO_RE = re.compile(r"KV pool ([0-9.]+) MiB \(--kv-pool-mb auto\): (.*)")
CAPACITY_MIB_RE = re.compile(r"KV pool ([0-9.]+) MiB of \S+ K and V")


def auto_line(d):
    m = AUTO_RE.search(d.stderr())
    assert m, d.stderr()
    return float(m.group(1)), m.group(2)


def mem_available_mib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    pytest.skip("this kernel's /proc/meminfo has no MemAvailable")


def test_auto_pool_holds_max_running_full_images(start_daemon):
    """The demo model's full-cache image is a few MiB: the cap is what binds,
    and the pool holds exactly --max-running of them."""
    d = start_daemon(SHAPES, args=["--max-running", "3"])
    mib, why = auto_line(d)
    image = full_image_kv_bytes(SHAPES) / 2**20
    assert why.startswith(f"what --max-running 3 full-cache images need ({image:.1f} MiB each)"), why
    assert mib == pytest.approx(3 * image, rel=0.01), (mib, image)
    assert capacity_cells(d.stderr())["full"] == "full 3 images"
    r = d.client.post("/v1/images/generations", json={"prompt": "a red circle", "n": 3})
    assert r.status_code == 200, r.text


def test_auto_pool_takes_its_share_of_available_memory(start_daemon):
    """When --max-running images would need more, the pool is --kv-pool-share
    of the available RAM."""
    d = start_daemon(SHAPES, args=["--max-running", "4096", "--kv-pool-share", "0.002"])
    mib, why = auto_line(d)
    m = re.fullmatch(r"0\.2% of the ([0-9]+) MiB of (available RAM|the cgroup's room)", why)
    assert m, why
    assert mib == pytest.approx(0.002 * int(m.group(1)), rel=0.01, abs=0.2)
    # the figure is this machine's, read while the daemon started
    assert 0.2 * mem_available_mib() < int(m.group(1)) <= 1.2 * mem_available_mib()


def test_a_given_size_is_taken_as_given(start_daemon):
    d = start_daemon(SHAPES, args=["--kv-pool-mb", "64"])
    assert not AUTO_RE.search(d.stderr())
    assert float(CAPACITY_MIB_RE.search(d.stderr()).group(1)) == pytest.approx(64, abs=0.5)


STATUS_RE = re.compile(r"status: ([0-9]+) running, ([0-9]+) waiting; ([0-9]+) images in ([0-9]+) s "
                       r"\(([0-9.]+)/s\), ([0-9.]+) iterations/s; KV pool ([0-9.]+) of ([0-9.]+) MiB "
                       r"in use \(([0-9.]+)%\), ([0-9.]+) MiB planned")


def test_a_status_line_while_busy(start_daemon):
    """--status-interval-s: while requests run or wait, a line this often, and
    one after the last finishes; the lines' images add up to those drawn, and
    no line comes from an idle daemon."""
    import time
    from conftest import scaled
    d = start_daemon(SHAPES, args=["--status-interval-s", "1", "--max-running", "2"])
    for _ in range(3):
        r = d.client.post("/v1/images/generations", json={"prompt": "a red circle", "n": 2})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + scaled(15)
    while True:
        lines = STATUS_RE.findall(d.stderr())
        if sum(int(m[2]) for m in lines) >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(int(m[2]) for m in lines) == 6, d.stderr()
    for running, waiting, images, secs, rate, its, used, cap, pct, planned in lines:
        assert int(running) or int(waiting) or float(its) > 0 or int(images), lines  # not idle
        assert float(cap) > 0 and float(used) <= float(cap)
    quiet = start_daemon(SHAPES, args=["--status-interval-s", "0"])
    r = quiet.client.post("/v1/images/generations", json={"prompt": "a red circle"})
    assert r.status_code == 200 and "status:" not in quiet.stderr()
