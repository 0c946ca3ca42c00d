"""The inside of an agent sandbox (see primerl_sandbox.workspace): one process that runs the
agent's commands and file operations in /work, one request at a time.

Runs as `python3 -I -S -B -c <this file> LIMITS_JSON` inside bubblewrap and imports only the
standard library. It reads one JSON request per line on stdin and writes one JSON reply per
line on stdout, `{"id": <the request's id>, ...}`. It makes itself non-dumpable first, so that
the agent's processes (same user) cannot open its pipes through /proc and forge replies. Every
command runs as `bash -c` in its own process group with stdin from /dev/null, the sandbox's
rlimits, its output read up to a bound (the rest drained and counted), killed with its whole
group at its time limit; the working directory and exported variables carry from one command
to the next through /tmp/.shell (a persistent shell as the agent sees it, without a shell
that a stray `read` or `exit` could wedge).
"""

import base64
import ctypes
import hashlib
import io
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import tarfile
import time

WORK = "/work"
STATE = "/tmp/.shell"
WRAPPER = """
__primerl_save() { pwd > /tmp/.shell/cwd; export -p | grep -v ' PRIMERL_COMMAND=' > /tmp/.shell/env; } 2>/dev/null
trap __primerl_save EXIT
cd -- "$(cat /tmp/.shell/cwd 2>/dev/null || echo /work)" 2>/dev/null || cd /work
set -a; . /tmp/.shell/env 2>/dev/null; set +a
eval "$PRIMERL_COMMAND"
"""


def limits_for_children(limits: dict) -> None:
    for name, value in [
        ("RLIMIT_AS", limits["memory_bytes"]),
        ("RLIMIT_CPU", limits["cpu_s"]),
        ("RLIMIT_FSIZE", limits["file_bytes"]),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_NOFILE", 256),
    ]:
        resource.setrlimit(getattr(resource, name), (value, value))
    os.setpgid(0, 0)


def run(req: dict, limits: dict) -> dict:
    timeout = float(req["seconds"])
    limit = int(req["output_bytes"])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb"}
    env["PRIMERL_COMMAND"] = req["command"]
    proc = subprocess.Popen(
        ["/bin/bash", "--noprofile", "--norc", "-c", WRAPPER],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=WORK,
        env=env,
        preexec_fn=lambda: limits_for_children(limits),
    )
    assert proc.stdout is not None and proc.stderr is not None
    fds = {"stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno()}
    out = {fd: bytearray() for fd in fds.values()}
    seen = {fd: 0 for fd in fds.values()}
    sel = selectors.DefaultSelector()
    for fd in out:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    timed_out = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = proc.poll() is None
            break
        if proc.poll() is not None:  # bash is done: what it left running goes, its output is read
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = min(deadline, time.monotonic() + 1.0)  # a writer that left the group: 1 s more
        for key, _ in sel.select(min(left, 0.05)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            seen[key.fd] += len(chunk)
            buf = out[key.fd]
            buf += chunk[: max(0, limit - len(buf))]
    if timed_out:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    try:  # what the command left running in the background goes too: one command, one group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.stdout.close()
    proc.stderr.close()
    reply: dict = {"exit_code": code, "timed_out": timed_out}
    for name, fd in fds.items():
        reply[name] = out[fd].decode(errors="replace")
        reply[f"{name}_bytes"] = seen[fd]
    return reply


def inside(path: str) -> str:
    """`path` relative to /work (or absolute), normalised; anything in the sandbox is fair game:
    the sandbox is the boundary, not this check."""
    return os.path.normpath(os.path.join(WORK, path))


def read(req: dict) -> dict:
    with open(inside(req["path"]), "rb") as f:
        data = f.read(int(req["max_bytes"]) + 1)
    return {"data": base64.b64encode(data).decode()}


def write(req: dict) -> dict:
    path = inside(req["path"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(req["data"]))
    return {}


def listing(req: dict) -> dict:
    top = inside(req["path"])
    depth, most = int(req["depth"]), int(req["max_entries"])
    entries, more = [], False
    for root, dirs, files in os.walk(top):
        level = 0 if root == top else os.path.relpath(root, top).count(os.sep) + 1  # its entries: level + 1
        dirs.sort()
        names = dirs + sorted(files)
        if level + 1 >= depth:
            dirs[:] = []
        for name in names:
            if len(entries) >= most:
                more = True
                break
            full = os.path.join(root, name)
            entries.append(os.path.relpath(full, top) + ("/" if os.path.isdir(full) else ""))
        if more:
            break
    if not os.path.isdir(top):
        raise NotADirectoryError(req["path"])
    return {"entries": entries, "more": more}


HASHES: dict = {}
"""path -> ((inode, size, mtime_ns, ctime_ns), sha256): a file whose stat is unchanged is not
read again (the toolset asks for the changes after every tool call that can change files)."""


def tree() -> dict:
    """path -> ("f", sha256) | ("l", link target) of everything under /work."""
    found = {}
    for root, dirs, files in os.walk(WORK):
        for name in dirs + files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, WORK)
            if os.path.islink(full):
                found[rel] = ("l", os.readlink(full))
            elif name in files and os.path.isfile(full):
                st = os.stat(full)
                key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                cached = HASHES.get(rel)
                if cached is None or cached[0] != key:
                    with open(full, "rb") as f:
                        cached = HASHES[rel] = (key, hashlib.sha256(f.read()).hexdigest())
                found[rel] = ("f", cached[1])
    return found


BASELINE = {}


def extract(req: dict) -> dict:
    data = base64.b64decode(req["tar"])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and newer
            tar.extractall(WORK, filter="data")
        else:
            tar.extractall(WORK)
    BASELINE.clear()
    BASELINE.update(tree())
    return {"files": len(BASELINE)}


def changes(req: dict) -> dict:
    most = int(req["max_bytes"])
    now = tree()
    files, links, total = {}, {}, 0
    for rel, entry in sorted(now.items()):
        if BASELINE.get(rel) == entry:
            continue
        if entry[0] == "l":
            links[rel] = entry[1]
            continue
        with open(os.path.join(WORK, rel), "rb") as f:
            data = f.read(most - total + 1)
        total += len(data)
        if total > most:
            return {"error": f"the changed files hold more than {most} bytes"}
        files[rel] = base64.b64encode(data).decode()
    deleted = sorted(rel for rel in BASELINE if rel not in now)
    return {"files": files, "symlinks": links, "deleted": deleted}


def apply(req: dict) -> dict:
    for rel in req["deleted"]:
        path = inside(rel)
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
    for rel, data in req["files"].items():
        write({"path": rel, "data": data})
    for rel, target in req["symlinks"].items():
        path = inside(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(target, path)
    return {}


def main() -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: its pipes are not the agent's to open
    limits = json.loads(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    os.makedirs(STATE, exist_ok=True)
    ops = {"run": lambda r: run(r, limits), "read": read, "write": write, "list": listing}
    ops.update({"extract": extract, "changes": changes, "apply": apply})
    out = sys.stdout
    print(json.dumps({"id": 0, "ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = None
        try:
            req = json.loads(line)
            reply: dict = ops[req["op"]](req)
        except Exception as e:  # the agent's error (a missing file, a bad path): its reply
            reply = {"error": f"{type(e).__name__}: {e}"[:1000]}
        reply["id"] = req.get("id") if isinstance(req, dict) else None
        print(json.dumps(reply), file=out, flush=True)


main()
