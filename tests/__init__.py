"""pollbridge's tests: a package, so the shared helpers are imported as :mod:`tests.support`.

Each test folder is a package too (test modules are ``tests.unit.test_x`` and so on, and two folders may
hold files of the same name); ``pythonpath = ["."]`` in pyproject.toml's pytest section puts the repository
root on ``sys.path``.
"""
