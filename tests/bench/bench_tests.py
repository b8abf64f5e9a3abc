"""The runner of tests/bench/'s plain-Python test files (no pytest in the bench venv): each
test_* function of a module in name order, "ok"/"not ok" a line and "N passed, N failed"
last, as the C unit tests print."""


def run(namespace):
    """Runs the test_* functions of `namespace` (a module's globals()); True if one failed."""
    tests = [(n, f) for n, f in sorted(namespace.items()) if n.startswith("test_")]
    passed = failed = 0
    for name, f in tests:
        try:
            f()
        except Exception as e:  # noqa: BLE001 (a crash is a failure too)
            failed += 1
            print("not ok  %s\n  %r" % (name, e))
        else:
            passed += 1
            print("ok      %s" % name)
    print("%d passed, %d failed" % (passed, failed))
    return failed != 0
