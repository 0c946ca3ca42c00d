"""primerl-sandbox-runner: the child side of the code sandbox (see primerl_code.sandbox).

Runs inside the sandbox as `python -I -S -B -c <this file> MEMORY CPU FSIZE NPROC` and imports
only the standard library. It sets its own resource limits, moves its result channel off fd 1
(fd 1 and 2 become /dev/null, so whatever the submission prints goes nowhere), reads the
submission's source (first line of stdin, JSON) and runs it, and only then reads the calls to
make (second line, JSON `[[function name, [args...]], ...]`; the expected values never come
here). One line per call goes to the result channel:

    {"i": 3, "v": <the return value, as JSON>}     or     {"i": 3, "error": "TypeError: ..."}

and `{"error": "..."}` when the submission fails to run. The parent trusts none of it: it
compares each value with an expected one it kept, and counts each index at most once, so a line
the submission forges can at most claim return values for the given inputs, which is solving
the task. A value that is not JSON (an object whose `__eq__` always says True) fails its test.
"""

import json
import os
import resource
import sys

VALUE_LIMIT = 1 << 16
"""Longest return value reported, in bytes of JSON; a longer one fails its test."""


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def set_limits(memory: int, cpu_s: int, fsize: int, nproc: int) -> None:
    """Hard limits, which the sandbox's unprivileged user cannot raise again."""
    for name, value in [
        ("RLIMIT_AS", memory),
        ("RLIMIT_FSIZE", fsize),
        ("RLIMIT_NOFILE", 64),
        ("RLIMIT_NPROC", nproc),
        ("RLIMIT_CORE", 0),
    ]:
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))


def call(namespace: dict, fn: str, args: list) -> str:
    """The JSON of `namespace[fn](*args)`; raises whatever the call or the encoding raises."""
    function = namespace.get(fn)
    if not callable(function):
        raise NameError(f"the solution defines no function {fn!r}")
    value = json.dumps(function(*args))
    if len(value) > VALUE_LIMIT:
        raise ValueError(f"return value over {VALUE_LIMIT} bytes of JSON")
    return value


def main() -> None:
    set_limits(*(int(a) for a in sys.argv[1:5]))
    out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    code = json.loads(sys.stdin.readline())
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
    except BaseException as e:
        out.write(json.dumps({"error": f"the solution failed to run: {describe(e)}"}) + "\n")
        out.flush()
        os._exit(0)
    for i, (fn, args) in enumerate(json.loads(sys.stdin.readline())):
        try:
            line = f'{{"i": {i}, "v": {call(namespace, fn, args)}}}'
        except BaseException as e:
            line = json.dumps({"i": i, "error": describe(e)})
        out.write(line + "\n")
        out.flush()
    os._exit(0)  # no atexit handlers or finalizers of the submission's


if __name__ == "__main__":
    main()
