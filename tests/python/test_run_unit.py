"""tests/run_unit.sh, the driver of the C test binaries: UNIT_JOBS at a time, each one's
output whole and in the order given, the passed and failed counts summed, and a failure
(a failed check, a binary that ends without its summary line) failing the run."""
import os
import subprocess

import pytest

from conftest import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_UNIT = os.path.join(ROOT, "tests", "run_unit.sh")


def script(tmp_path, name, body):
    p = tmp_path / name
    p.write_text("#!/usr/bin/env bash\n" + body)
    p.chmod(0o755)
    return str(p)


def blocks(out):
    """(binary, its output lines) for each "== binary" block of run_unit.sh's output."""
    got = []
    for line in out.splitlines():
        if line.startswith("== "):
            got.append((line[3:], []))
        elif got:
            got[-1][1].append(line)
    return got


def run(*tests, jobs=None):
    env = dict(os.environ)
    env.pop("UNIT_JOBS", None)
    if jobs is not None:
        env["UNIT_JOBS"] = str(jobs)
    return subprocess.run([RUN_UNIT, *tests], capture_output=True, text=True, env=env,
                          timeout=scaled(60))


def test_two_at_a_time_output_in_the_order_given(tmp_path):
    """The first binary waits for a file the second writes: it ends only if both run at
    once, and its output still comes first."""
    flag = tmp_path / "second-started"
    polls = int(scaled(30) * 100)  # 0.01 s each
    first = script(tmp_path, "first", f"""
for i in $(seq {polls}); do [ -e {flag} ] && break; sleep 0.01; done
[ -e {flag} ] || {{ echo "0 passed, 1 failed"; exit 1; }}
echo "first ran beside the second"; echo "2 passed, 0 failed"
""")
    second = script(tmp_path, "second", f'touch {flag}; echo "3 passed, 0 failed"\n')
    p = run(first, second, jobs=2)
    assert p.returncode == 0, p.stdout
    (b1, out1), (b2, out2) = blocks(p.stdout)
    assert (b1, b2) == (first, second), p.stdout
    assert out1[:2] == ["first ran beside the second", "2 passed, 0 failed"], p.stdout
    assert out2[0] == "3 passed, 0 failed", p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == "5 passed, 0 failed", p.stdout


def test_failures_are_counted_and_fail_the_run(tmp_path):
    ok = script(tmp_path, "ok", 'echo "4 passed, 0 failed"\n')
    failed = script(tmp_path, "failed", 'echo "1 passed, 2 failed"; exit 1\n')
    crashed = script(tmp_path, "crashed", 'echo "half a line"; kill -SEGV $$\n')
    p = run(ok, failed, crashed, ok, jobs=2)
    assert p.returncode != 0, p.stdout
    assert f"!! {crashed} printed no summary" in p.stdout, p.stdout
    # the crashed binary counts as one failure
    assert p.stdout.rstrip().splitlines()[-1] == "9 passed, 3 failed", p.stdout
    got = blocks(p.stdout)
    assert [b for b, _ in got] == [ok, failed, crashed, ok], p.stdout
    assert [out[0] for _, out in got] == ["4 passed, 0 failed", "1 passed, 2 failed", "half a line",
                                          "4 passed, 0 failed"], p.stdout


def test_a_summary_with_a_nonzero_exit_fails_the_run(tmp_path):
    liar = script(tmp_path, "liar", 'echo "1 passed, 0 failed"; exit 3\n')
    p = run(liar, jobs=1)
    assert p.returncode != 0 and p.stdout.rstrip().endswith("1 passed, 0 failed"), p.stdout


@pytest.mark.parametrize("jobs", ["0", "two", "-1"])
def test_unit_jobs_must_be_a_positive_integer(tmp_path, jobs):
    ok = script(tmp_path, "ok", 'echo "1 passed, 0 failed"\n')
    p = run(ok, jobs=jobs)
    assert p.returncode == 2 and "UNIT_JOBS must be a positive integer" in p.stdout, p.stdout
