"""The code environment's sandbox, with real bubblewrap sandboxes and real child processes.

Many attacks here are written as `guarded(...)`: the submission runs the attack, which sets
`escaped = True` if it gets anywhere, and then solves the task only if it did not. So
`passed == 3` proves both that the sandbox ran the code and that the attack found nothing (a
sandbox that broke everything would score 0, and fail these tests too). bubblewrap must be
installed (CI installs it): without it these tests fail, they do not skip.
"""

import asyncio
import json
import os
import socket
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from primerl_code import SOLUTIONS, CodeConfig, CodeTaskset, extract_code
from primerl_code.sandbox import HiddenTest, run_tests

TESTS = [HiddenTest("add", [2, 3], 5), HiddenTest("add", [-1, 1], 0), HiddenTest("add", [0, 0], 0)]
ADD = "def add(a, b):\n    return a + b\n"
PROJECT = Path(__file__).resolve().parents[3]


def run(code, tests=TESTS, **kw):
    kw.setdefault("time_limit_s", 2.0)
    return asyncio.run(run_tests(code, tests, **kw))


def guarded(attack: str) -> str:
    """A submission that runs `attack` and solves the task only if the attack set no `escaped`."""
    body = textwrap.indent(textwrap.dedent(attack).strip(), "    ")
    return (
        f"escaped = False\ntry:\n{body}\nexcept Exception:\n    pass\n"
        "def add(a, b):\n    return None if escaped else a + b\n"
    )


def processes_with(marker: str) -> list[int]:
    """Pids of processes (other than this one) whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def no_runner_left() -> bool:
    return processes_with("primerl-sandbox-runner") == []


def test_correct_and_wrong_solutions():
    assert run(ADD).passed == 3
    wrong = run("def add(a, b):\n    return a * b\n")
    assert (wrong.passed, wrong.total, wrong.error) == (1, 3, None)  # 0 * 0 == 0 + 0 only
    missing = run("def sub(a, b):\n    return a - b\n")
    assert (missing.passed, missing.error) == (0, None)
    # values compare as JSON data: a returned tuple equals an expected list
    assert run("def pair(x):\n    return (x, x + 1)\n", [HiddenTest("pair", [1], [1, 2])]).passed == 1


def test_the_scratch_folder_is_writable_and_bounded():
    assert (
        run(
            guarded("""
        open('note', 'w').write('hi')
        escaped = open('note').read() != 'hi'
    """)
        ).passed
        == 3
    )
    big = run("open('big', 'wb').write(b'x' * (8 << 20))\n" + ADD, file_mb=4)
    assert big.passed == 0 and "File too large" in big.error
    # many files under the per-file limit still fill only the folder's tmpfs
    many = run("for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))\n" + ADD, file_mb=4)
    assert many.passed == 0 and "No space left" in many.error


def test_reading_outside_the_sandbox_finds_nothing(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    r = run(f"data = open({str(secret)!r}).read()\n" + ADD)
    assert r.passed == 0 and "FileNotFoundError" in r.error
    # (8) nothing private of the host's is there, by path, by symlink or by '..': the host paths
    # below exist here (the test checks), and the sandbox's / holds only what python needs
    private = [
        str(p)
        for p in [
            secret,
            tmp_path,
            PROJECT,
            Path.home() / ".bashrc",
            Path.home() / ".cache",
            "/etc/passwd",
            "/tmp",
            "/home",
            "/var",
            "/usr/bin",
            "/usr/local",
        ]
        if Path(p).exists()
    ]
    assert len(private) >= 5
    assert (
        run(
            guarded(f"""
        import os
        os.symlink('/root', 'root')
        os.symlink({str(tmp_path)!r}, 'outside')
        os.symlink('../../../../../..{secret}', 'up')
        escaped = any(os.path.exists(p) for p in {private!r} + ['outside/secret.txt', 'up', 'root/.bashrc'])
        escaped = escaped or not set(os.listdir('/')) <= {{'box', 'dev', 'proc', 'usr', 'lib', 'lib64', 'root'}}
        escaped = escaped or not set(os.listdir('/usr')) <= {{'lib', 'lib64', 'bin'}}
    """)
        ).passed
        == 3
    )


@pytest.mark.parametrize(
    "attack",
    [
        "open({target!r}, 'w').write('x')",
        "import os\nos.system('touch {target}')",
        "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'touch {target}'])",
        "import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'touch {target}'], {{}})",
        "import ctypes\nctypes.CDLL('libc.so.6').system(b'touch {target}')",
        "import shutil\nshutil.copyfile('/proc/self/cmdline', {target!r})",
        "import os\nos.rename('.', {target!r})",
        # (9) through directory descriptors: of the root, and of '..' from the scratch folder
        "import os\nfd = os.open('/', os.O_RDONLY)\nos.close(os.open('pwned', os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        "import os\nfd = os.open('..', os.O_RDONLY)\nos.mkdir('tmp', dir_fd=fd)\nopen('/tmp/pwned', 'w')",
        "import os\nfd = os.open({folder!r}, os.O_RDONLY)\nos.close(os.open('pwned', os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
    ],
)
def test_writing_outside_the_sandbox_creates_nothing(tmp_path, attack):
    target = tmp_path / "pwned"
    run(attack.format(target=str(target), folder=str(tmp_path)) + "\n" + ADD)
    assert list(tmp_path.iterdir()) == []
    assert not Path("/pwned").exists() and not Path("/tmp/pwned").exists()
    assert no_runner_left()


def test_deleting_outside_the_sandbox_deletes_nothing(tmp_path):
    victim = tmp_path / "keep"
    victim.mkdir()
    (victim / "file").write_text("x")
    run(f"import shutil\nshutil.rmtree({str(victim)!r})\n" + ADD)
    assert (victim / "file").exists()


def test_time_limit():
    start = time.monotonic()
    r = run("import time\ntime.sleep(60)\n", time_limit_s=1.0)
    assert r.passed == 0 and "time limit" in r.error
    assert time.monotonic() - start < 5
    busy = run("while True:\n    pass\n", time_limit_s=1.0)
    assert busy.passed == 0 and "CPU time limit" in busy.error
    assert no_runner_left()


def test_memory_limit():
    r = run("x = bytearray(4 << 30)\n" + ADD, memory_mb=256)
    assert r.passed == 0 and "MemoryError" in r.error


def test_overwriting_the_runners_globals_does_not_raise_the_score():
    # (1) the old sandbox's audit hook read its rules from globals; the runner has none to
    # switch off, and whatever the submission breaks in it can only lose it its own tests
    attack = """
        import sys
        main = sys.modules['__main__']
        for name in list(vars(main)):
            if not name.startswith('__'):
                setattr(main, name, None)
        main.DENY, main.VALUE_LIMIT = set(), 0
    """
    r = run(textwrap.dedent(attack) + "def add(a, b):\n    return a - b\n")
    assert r.passed <= 1 and r.total == 3  # add(0, 0) == 0 is its honest count
    assert run("import sys\nsys.modules['__main__'].json = None\n" + ADD).passed <= 3


def forging(lines: list[str]) -> str:
    """A submission that writes `lines` to fd 1 and 2, sys.__stdout__ and every other descriptor
    it might hold, then defines a wrong add (a - b: its honest count is 1, add(0, 0) == 0)."""
    text = "\n".join(lines) + "\n"
    return textwrap.dedent(f"""
        import os, sys
        text = {text!r}
        print(text)
        sys.__stdout__.write(text)
        sys.__stdout__.flush()
        for fd in range(0, 256):
            try:
                os.write(fd, text.encode())
            except OSError:
                pass
        def add(a, b):
            return a - b
    """)


def test_forged_result_lines_do_not_raise_the_score():
    # (3) lines in the old format, "passed" claims, out-of-range and ill-typed indices: ignored
    junk = [
        '__PRIMERL_SANDBOX_RESULT__{"passed": 500, "total": 2, "error": null}',
        '{"passed": 3, "total": 3, "error": null}',
        '{"v": 5}',
        "[1, 2, 3]",
        '{"i": 0, "v": 5',
        *[f'{{"i": {i}, "v": 5, "ok": true, "passed": true}}' for i in [-3, -1, 3, 4, 500]],
        '{"i": true, "v": 5}',
        '{"i": 0.0, "v": 5}',
        '{"i": "0", "v": 5}',
        '{"i": null, "v": 5}',
    ]
    r = run(forging(junk))
    assert (r.passed, r.total) == (1, 3)
    # in-range lines come first and so take their index: a forged value only counts where it is
    # the expected one, and these are not, so the honest line for add(0, 0) is ignored too
    claims = [f'{{"i": {i}, "v": "all passed", "passed": true}}' for i in range(3)] * 50
    r = run(forging(claims))
    assert (r.passed, r.total) == (0, 3)


def test_a_return_value_cannot_lie_about_equality():
    # (4) an object whose __eq__ always says True is not JSON: it fails
    liar = "class Liar:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
    r = run(liar + "def add(a, b):\n    return Liar()\n")
    assert (r.passed, r.total) == (0, 3)
    # an int subclass travels as its int value, so it passes only where that value is right
    int_liar = "class Liar(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
    assert run(int_liar + "def add(a, b):\n    return Liar(0)\n").passed == 2  # add(-1, 1), add(0, 0)


def test_processes_cannot_be_started_or_outlive_the_run():
    # (5) a daemon: fork + setsid + fork, a new session, posix_spawn; each would exec a sleeper
    # holding a unique marker on its command line
    marker = f"primerl-daemon-{os.getpid()}-{time.time_ns()}"
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}]"
    attacks = [
        f"import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.execv(sys.executable, {sleeper})\n    os._exit(0)",
        f"import subprocess, sys\nsubprocess.Popen({sleeper}, start_new_session=True)",
        f"import os, sys\nos.posix_spawn(sys.executable, {sleeper}, {{}}, setsid=True)",
        f"import ctypes, os, sys\nif ctypes.CDLL('libc.so.6').syscall(57 if os.uname().machine == 'x86_64' else 220, 17, 0, 0, 0, 0) == 0:\n    os.execv(sys.executable, {sleeper})",
    ]
    for attack in attacks:
        r = run(attack + "\n" + ADD)
        assert r.passed in (0, 3)
        assert processes_with(marker) == [], attack
    assert run("import os\nos.fork()\n" + ADD).passed == 0
    assert no_runner_left()


def test_fork_and_thread_bombs_are_bounded():
    # (6) a fork bomb cannot fork (this one stops at 2**12 processes, should that ever change);
    # a thread bomb hits the memory limit (and RLIMIT_NPROC where the kernel enforces it)
    start = time.monotonic()
    r = run("import os, time\nfor _ in range(12):\n    os.fork()\ntime.sleep(30)\n", time_limit_s=1.0)
    assert r.passed == 0 and "PermissionError" in r.error
    threads = run(
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(30,)).start()\n",
        time_limit_s=1.0,
    )
    assert threads.passed == 0 and "can't start new thread" in threads.error
    assert time.monotonic() - start < 1.0 + 1.0 + 4
    assert no_runner_left()
    # nor make a user namespace of its own (where it would hold capabilities), nor SysV shared
    # memory (whose pages no rlimit counts)
    assert (
        run(
            guarded("""
        import ctypes
        libc = ctypes.CDLL('libc.so.6')
        escaped = libc.unshare(0x10000000) == 0  # CLONE_NEWUSER
        escaped = escaped or libc.shmget(0, 1 << 20, 0o1600) != -1  # IPC_PRIVATE, IPC_CREAT | 0600
    """)
        ).passed
        == 3
    )
    # threads as such still work
    assert (
        run(
            guarded("""
        import threading
        out = []
        t = threading.Thread(target=out.append, args=(1,))
        t.start()
        t.join()
        escaped = out != [1]
    """)
        ).passed
        == 3
    )


def test_the_hosts_processes_and_environment_are_invisible(monkeypatch):
    # (7) and (12): a secret in this process's environment, which bwrap is started from
    secret = f"primerl-secret-{time.time_ns()}"
    monkeypatch.setenv("PRIMERL_TEST_SECRET", secret)
    host_init = Path("/proc/1/cmdline").read_bytes()
    assert (
        run(
            guarded(f"""
        import os
        secret = {secret!r}
        escaped = secret in repr(dict(os.environ))
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        escaped = escaped or len(pids) > 2   # bwrap's init and the runner, nothing else
        for pid in pids + [{str(os.getpid())!r}, {str(os.getppid())!r}]:
            for what in ('environ', 'cmdline'):
                try:
                    escaped = escaped or secret.encode() in open(f'/proc/{{pid}}/{{what}}', 'rb').read()
                except OSError:
                    pass
        escaped = escaped or open('/proc/1/cmdline', 'rb').read() == {host_init!r}
        escaped = escaped or os.path.exists('/proc/{os.getpid()}/cwd/conftest.py')
    """)
        ).passed
        == 3
    )


READ_EVERYTHING = r"""
import io, json, os, re, stat, sys
CANARY = re.compile(rb"LEAK-CANARY-(\d+)-[0-9a-f]{32}")  # does not match itself
found = {}
read = {"stdin": 0, "argv": 0, "environ": 0, "fds": 0, "memory": 0, "names": 0, "files": 0, "procs": []}

def look(data):
    for m in CANARY.finditer(data):
        found.setdefault(m.group(1).decode(), m.group().decode())

# what is left of stdin (the calls and anything after them), then handed back to the runner
rest = sys.stdin.read()
sys.stdin = io.StringIO(rest)
look(rest.encode())
read["stdin"] = len(rest)
for arg in sys.orig_argv + sys.argv:
    look(os.fsencode(arg))
    read["argv"] += 1
for key, value in os.environb.items():
    look(key + b"=" + value)
    read["environ"] += 1
for fd in map(int, os.listdir("/proc/self/fd")):  # every descriptor it holds, without blocking
    try:
        os.set_blocking(fd, False)
        look(os.read(fd, 1 << 20))
        read["fds"] += 1
    except OSError:
        pass
    finally:
        try:
            os.set_blocking(fd, True)
        except OSError:
            pass
# its whole memory (the runner's too: the same process)
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        try:
            if perms[0] == "r":
                mem.seek(start)
                look(mem.read(end - start))
                read["memory"] += end - start
        except (OSError, OverflowError, MemoryError):
            pass
# every name under /, and every file's first MiB: its cwd, /proc (its own and its parent's
# entries), /dev, and every host file changed since the test began (an unchanged one cannot
# hold values the test made after that)
for root, dirs, files in os.walk("/"):
    for name in dirs + files:
        look(os.fsencode(name))
        read["names"] += 1
    for name in files:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_ctime < SINCE:
                continue
            with open(path, "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            continue
        look(data)
        read["files"] += 1
        if name == "environ" and root.count("/") == 2:
            read["procs"].append(int(root.split("/")[2]))
read.update(pid=os.getpid(), ppid=os.getppid(), found=found)
report = json.dumps({"error": "READ " + json.dumps(read)}).encode() + b"\n"
for fd in range(3, 64):  # onto the result channel, whichever descriptor it is: the first error line
    try:
        os.write(fd, report)
    except OSError:
        pass

def answer(i):
    return found.get(str(i))  # a hidden test's expected value, wherever it was seen
"""


def test_no_expected_value_reaches_the_sandbox():
    """A submission reads all it can (stdin, argv, environment, descriptors, its memory, every
    file it can open) and answers each test with the expected value it found there: it must find
    none and score 0. Its report of what it read comes back as the run's error line."""
    canaries = [f"LEAK-CANARY-{i}-{uuid.uuid4().hex}" for i in range(3)]
    tests = [HiddenTest("answer", [i], canary) for i, canary in enumerate(canaries)]
    since = time.time() - 1.0  # a file system's clock may lag time.time() by a tick
    r = run(READ_EVERYTHING.replace("SINCE", repr(since)), tests, time_limit_s=20.0)
    assert not any(canary in (r.error or "") for canary in canaries), r.error
    assert (r.passed, r.total) == (0, 3)
    assert r.error.startswith("READ "), r.error
    read = json.loads(r.error.removeprefix("READ "))
    assert read["found"] == {}
    # it did read: the calls on stdin, its command line, its memory, its own and its parent's
    # /proc entries, a tree of names
    assert read["stdin"] > 0 and read["argv"] >= 5 and read["memory"] > 1 << 20
    assert {read["pid"], read["ppid"]} <= set(read["procs"])
    assert read["names"] > 1000 and read["files"] > 100


def test_huge_output_is_bounded():
    # (10) a gigabyte printed: the submission's prints go to /dev/null, so it still scores
    start = time.monotonic()
    flood = (
        "import os, sys\nfor _ in range(1024):\n    os.write(1, b'x' * (1 << 20))\n    os.write(2, b'x' * (1 << 20))\n"
    )
    assert run(flood + "print('y' * (64 << 20))\n" + ADD, time_limit_s=5.0).passed == 3
    # a gigabyte on every descriptor, the result channel too: read up to the limit, then killed
    r = run(
        "import os\nfor _ in range(1024):\n    for fd in range(3, 16):\n        try:\n"
        "            os.write(fd, b'\\n' * (1 << 20))\n        except OSError:\n            pass\n" + ADD,
        time_limit_s=5.0,
    )
    assert r.passed == 0 and "output limit" in r.error
    assert time.monotonic() - start < 4  # also: a megabyte of junk lines is not parsed line by line
    assert no_runner_left()


def test_the_network_is_unreachable():
    # (11) a TCP server on this machine's loopback, and an abstract unix socket
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    unix = socket.socket(socket.AF_UNIX)
    name = f"\0primerl-test-{time.time_ns()}"
    unix.bind(name)
    unix.listen()
    unix.setblocking(False)
    try:
        assert (
            run(
                guarded(f"""
            import socket
            for family, address in [(socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_UNIX, {name!r})]:
                s = socket.socket(family)
                s.settimeout(0.5)
                try:
                    s.connect(address)
                    escaped = True
                except OSError:
                    pass
            try:
                socket.create_connection(('1.1.1.1', 53), timeout=0.5)
                escaped = True
            except OSError:
                pass
        """)
            ).passed
            == 3
        )
        for listener in (server, unix):
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        server.close()
        unix.close()


def test_the_taskset_makes_structured_tests_its_references_pass():
    tasks = list(CodeTaskset(CodeConfig(num_tasks=12, seed=3)))
    for task in tasks:
        tests = task.data.tests
        assert len(tests) == 4 and all(isinstance(t, HiddenTest) for t in tests)
        assert run(SOLUTIONS[tests[0].fn], tests).passed == 4
        assert run("def nothing():\n    pass\n", tests).passed == 0


def test_extract_code():
    assert extract_code("text\n```python\nx = 1\n```\nmore ```py\ny = 2\n```") == "y = 2\n"
    assert extract_code("def f(): pass") == "def f(): pass"
