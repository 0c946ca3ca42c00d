"""The code environment's sandbox, with real child processes."""

import asyncio
import time

import pytest
from primerl_code import extract_code
from primerl_code.sandbox import run_tests

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def run(code, **kw):
    return asyncio.run(run_tests(code, TESTS, **kw))


def test_correct_and_wrong_solutions():
    assert run("def add(a, b):\n    return a + b\n").passed == 3
    wrong = run("def add(a, b):\n    return a * b\n")
    assert (wrong.passed, wrong.total, wrong.error) == (1, 3, None)  # 0 * 0 == 0 + 0 only


def test_reading_outside_the_sandbox_scores_zero(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    r = run(f"data = open({str(secret)!r}).read()\ndef add(a, b): return a + b\n")
    assert r.passed == 0 and "not allowed" in r.error


@pytest.mark.parametrize("attack", [
    "open({target!r}, 'w').write('x')",
    "import os\nos.system('touch {target}')",
    "import shutil\nshutil.copyfile('/etc/hostname', {target!r})",
    "import os\nos.rename('.', {target!r})",
])
def test_writing_outside_the_sandbox_is_refused(tmp_path, attack):
    target = tmp_path / "pwned"
    r = run(attack.format(target=str(target)) + "\ndef add(a, b): return a + b\n")
    assert r.passed == 0
    assert not target.exists()


def test_deleting_outside_the_sandbox_is_refused(tmp_path):
    victim = tmp_path / "keep"
    victim.mkdir()
    (victim / "file").write_text("x")
    r = run(f"import shutil\nshutil.rmtree({str(victim)!r})\ndef add(a, b): return a + b\n")
    assert r.passed == 0 and (victim / "file").exists()


def test_time_limit():
    start = time.monotonic()
    r = run("import time\ntime.sleep(60)\n", time_limit_s=1.0)
    assert r.passed == 0 and "time limit" in r.error
    assert time.monotonic() - start < 10
    busy = run("while True:\n    pass\n", time_limit_s=1.0)
    assert busy.passed == 0 and busy.error


def test_memory_limit():
    r = run("x = bytearray(4 << 30)\ndef add(a, b): return a + b\n", memory_mb=256)
    assert r.passed == 0 and "MemoryError" in r.error


def test_processes_and_sockets_are_refused():
    assert run("import os\nos.fork()\ndef add(a, b): return a + b\n").passed == 0
    assert run("import socket\nsocket.socket()\ndef add(a, b): return a + b\n").passed == 0


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore ```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(): pass") == "def f(): pass"
