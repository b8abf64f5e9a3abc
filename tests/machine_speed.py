"""Time bounds from this machine's measured speed, for the pytest suites
(tests/integration, tests/python): their conftest.py imports the hooks below.

Bounds in the tests are written in seconds of the reference machine: a normal
build on the 2-core AVX-512 machine the suites were written on, nothing else
running. Before the first test, the session times one slow-model image on the
build under test (sanitizer builds included), as many at once as there are
pytest-xdist workers to share the cores, and every bound is stretched by how
much slower that image ran here (scaled(); never shrunk below the written
bound). pytest-timeout's limits are stretched the same way, and a failed
test's report says what was measured. The controller's measurement reaches
the workers in ARSERVE_TEST_SPEED.

The binary and the slow model come from ARSERVE_BIN and ARSERVE_SLOW_MODEL
(the Makefile sets them), else build/arserve and build/slow-model.
"""
import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One slow-model image on one engine thread, `arserve generate` start-up
# included, on the reference machine.
REFERENCE_IMAGE_S = 0.40
SPEED_ENV = "ARSERVE_TEST_SPEED"
# Chooses the CPU kernels of every arserve process (kernels/cpu/vec_isa.h): kept in
# the environment the tests give the binaries they run.
ISA_ENV = "ARSERVE_ISA"


class Speed:
    """Seconds a slow-model image took on this build with `parallel` of them
    generating at once, and the factor bounds are stretched by."""

    def __init__(self, image_s, parallel):
        self.image_s = image_s
        self.parallel = parallel
        self.factor = max(1.0, image_s / REFERENCE_IMAGE_S)

    def describe(self):
        return (f"one slow-model image took {self.image_s:.2f} s on this build "
                f"({self.parallel} generating at once; {REFERENCE_IMAGE_S} s where the bounds "
                f"were written): time bounds x{self.factor:.2f}")


SPEED = Speed(REFERENCE_IMAGE_S, 1)  # until the session has measured


def scaled(seconds):
    """A time bound written for the reference machine, stretched by this one's speed."""
    return seconds * SPEED.factor


def _path(env, default):
    p = os.environ.get(env) or default
    return p if os.path.isabs(p) else os.path.join(REPO, p)


def measure(parallel):
    """Times `arserve generate` of one slow-model image on one engine thread in
    `parallel` processes at once; returns the seconds until the last was done."""
    binary = _path("ARSERVE_BIN", "build/arserve")
    model = _path("ARSERVE_SLOW_MODEL", "build/slow-model")
    for what, path in (("binary", binary), ("slow model", os.path.join(model, "arserve.json"))):
        if not os.path.exists(path):
            raise pytest.UsageError(f"the {what} {path} is missing: the session times it to "
                                    "scale its time bounds (`make test` builds it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARSERVE_") or k == ISA_ENV}
    out = tempfile.mkdtemp(prefix="arserve-speed-")
    try:
        t0 = time.monotonic()
        procs = [subprocess.Popen([binary, "generate", "--model", model, "--prompt", "a red circle",
                                   "--seed", str(i), "--threads", "1", "--quiet",
                                   "--output", os.path.join(out, f"{i}.png")],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env=env) for i in range(parallel)]
        for p in procs:
            log, _ = p.communicate()
            if p.returncode != 0:
                raise pytest.UsageError(f"timing the slow model: `{' '.join(p.args)}` exited "
                                        f"{p.returncode}:\n{log.decode(errors='replace')}")
        return time.monotonic() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)


def pytest_configure(config):
    """Measures the machine once per session; pytest-xdist's workers read the
    controller's measurement from the environment."""
    global SPEED
    known = os.environ.get(SPEED_ENV)
    if known:
        image_s, parallel = json.loads(known)
    else:
        parallel = getattr(config.option, "numprocesses", None) or 1
        image_s = measure(parallel)
        os.environ[SPEED_ENV] = json.dumps([image_s, parallel])
    SPEED = Speed(image_s, parallel)


def pytest_terminal_summary(terminalreporter):
    """Every run's log says what its bounds were scaled by (-q included)."""
    terminalreporter.write_line("machine speed: " + SPEED.describe())


def pytest_collection_modifyitems(config, items):
    """pytest-timeout's limits (an ini file's, or a test's own mark) are written
    for the reference machine too: each test gets its limit stretched."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = default
        if mark:
            limit = float(mark.args[0] if mark.args else mark.kwargs.get("timeout", default))
        if limit > 0:
            item.add_marker(pytest.mark.timeout(scaled(limit)), append=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says what the machine was measured at, so a bound
    that fired can be read against it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("machine speed", SPEED.describe()))
