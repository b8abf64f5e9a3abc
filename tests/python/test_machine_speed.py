"""tests/machine_speed.py, the suites' time bounds from the machine's speed: the
factor never shrinks a bound, and pytest-timeout's limits (the ini file's and a
test's own mark) reach each test stretched by it. Run in a pytest subprocess
given a measurement in ARSERVE_TEST_SPEED, so nothing is timed here."""
import json
import os

import pytest

import machine_speed

pytest_plugins = ["pytester"]

INNER_CONFTEST = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(machine_speed.__file__))!r})
from machine_speed import (pytest_collection_modifyitems, pytest_configure,
                           pytest_runtest_makereport, pytest_terminal_summary, scaled)
"""

INNER_TESTS = """
import pytest

def limit(request):
    return request.node.get_closest_marker("timeout").args[0]

def test_ini_limit(request):
    print("ini", limit(request))

@pytest.mark.timeout(7)
def test_own_limit(request):
    print("own", limit(request))

def test_a_bound_that_fires():
    assert False, "fired"
"""


def run_inner(pytester, image_s):
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makeini("[pytest]\ntimeout = 60\n")
    pytester.makepyfile(INNER_TESTS)
    os.environ[machine_speed.SPEED_ENV] = json.dumps([image_s, 1])
    try:
        return pytester.runpytest_subprocess("-s", "-p", "timeout")
    finally:
        del os.environ[machine_speed.SPEED_ENV]


def test_factor_is_the_measured_slowdown_and_never_below_one():
    ref = machine_speed.REFERENCE_IMAGE_S
    assert machine_speed.Speed(3 * ref, 2).factor == pytest.approx(3)
    assert machine_speed.Speed(ref / 2, 1).factor == 1
    assert "x3.00" in machine_speed.Speed(3 * ref, 2).describe()


def test_pytest_timeout_limits_are_stretched_by_the_measurement(pytester):
    result = run_inner(pytester, 2.5 * machine_speed.REFERENCE_IMAGE_S)
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "ini 150.0" in out, out
    assert "own 17.5" in out, out
    # What was measured is said at the end, and in the failed test's report.
    assert out.count("time bounds x2.50") >= 2, out


def test_a_fast_machine_keeps_the_written_limits(pytester):
    result = run_inner(pytester, machine_speed.REFERENCE_IMAGE_S / 4)
    out = result.stdout.str()
    assert "ini 60.0" in out and "own 7.0" in out, out
