"""How the code sandbox is isolated: bubblewrap's command line, a seccomp filter, a start-up check.

bubblewrap (`bwrap`, 0.8.0 or newer) starts the child in new user, mount, PID, network, IPC,
UTS and cgroup namespaces, as uid/gid 65534, in a new session, with no environment variables,
no further user namespaces, and killed when its parent dies. What the child sees:

  /                      an empty read-only tmpfs
  the interpreter        its binary, standard library and libpython, read-only at their own
                         paths; the standard library's site-packages under an empty read-only
                         tmpfs
  /usr/lib, /usr/lib64   read-only (the shared libraries; /lib and /lib64 as on the host)
  /proc                  a new procfs: only the sandbox's own processes
  /dev                   bubblewrap's minimal one (null, zero, random, urandom, tty), read-only
  /box                   the working directory: a tmpfs of `scratch_mb` MiB, the only place
                         it can write

and so not the project, /root, /tmp, /etc or any other process. The network namespace has
only its own loopback.

The seccomp filter refuses process creation (fork, vfork and clone without CLONE_THREAD fail
with EPERM; clone3 with ENOSYS, so that libc falls back to clone for threads, which stay
allowed) and SysV shared memory (shmget), whose pages no rlimit bounds. So a fork bomb or a
daemon cannot start at all. The filter is needed because the runner's RLIMIT_NPROC alone does
not hold when primerl runs as root: bubblewrap maps the uid inside (65534) to the caller's, and
the kernel does not enforce RLIMIT_NPROC on host root's processes.

`require(bwrap)` runs a probe once per process and bwrap path (a child that must start and
must fail to fork) and raises SandboxUnavailable, saying how to install bubblewrap, when it
does not work.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig

INSTALL_HINT = (
    "Install bubblewrap 0.8.0 or newer (`apt-get install bubblewrap`; `dnf install bubblewrap` on "
    "Fedora/RHEL) and allow unprivileged user namespaces (`user.max_user_namespaces` > 0, "
    "`kernel.unprivileged_userns_clone=1` where that sysctl exists, and on Ubuntu 23.10 or newer "
    "`kernel.apparmor_restrict_unprivileged_userns=0`). PRIMERL_BWRAP names another bwrap binary; "
    "PRIMERL_SANDBOX=unsafe-no-namespaces runs submissions without any isolation (only for code "
    "you trust)."
)


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create the sandbox's namespaces."""


def bwrap_path() -> str:
    """The bubblewrap binary: $PRIMERL_BWRAP, else `bwrap` on PATH."""
    return os.environ.get("PRIMERL_BWRAP") or shutil.which("bwrap") or "bwrap"


@functools.cache
def interpreter() -> tuple[str, list[str], list[str]]:
    """(the interpreter binary, the paths it needs bound read-only, the folders to hide).

    The base interpreter, not a virtual environment's: the child runs with -I -S and needs
    only the standard library.
    """
    exe = os.path.join(sys.base_prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    exe = os.path.realpath(exe if os.path.exists(exe) else sys.executable)
    base = {
        "base": sys.base_prefix,
        "platbase": sys.base_exec_prefix,  # not a venv's platstdlib
        "installed_base": sys.base_prefix,
        "installed_platbase": sys.base_exec_prefix,
    }
    stdlib, platstdlib = sysconfig.get_path("stdlib", vars=base), sysconfig.get_path("platstdlib", vars=base)
    binds = [exe, stdlib, platstdlib]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        binds.append(os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")))
    binds = sorted({os.path.realpath(p) for p in binds if os.path.exists(p)}, key=len)  # parents first
    hidden = [
        d for lib in {stdlib, platstdlib} for d in (f"{lib}/site-packages", f"{lib}/dist-packages") if os.path.isdir(d)
    ]
    return exe, binds, hidden


def namespace_args(bwrap: str) -> list[str]:
    """bwrap and its namespaces: everything unshared (the network included), uid/gid 65534
    inside, no further user namespaces, a new session, no environment, killed with its parent."""
    return [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]


def system_bind(path: str) -> list[str]:
    """`path` read-only as on the host: a symlink as the same symlink (/lib -> usr/lib), nothing
    when it does not exist."""
    if os.path.islink(path):
        return ["--symlink", os.readlink(path), path]
    if os.path.isdir(path):
        return ["--ro-bind", path, path]
    return []


def bwrap_argv(
    bwrap: str, command: list[str], *, seccomp_fd: int, scratch_mb: int, info_fd: int | None = None
) -> list[str]:
    """The bwrap command line that runs `command` in the sandbox (see the module docstring).

    Start it with an empty environment: bwrap's --clearenv clears the command's, but the
    sandbox's PID 1 is a fork of bwrap, and its /proc/1/environ is bwrap's own.
    """
    argv = namespace_args(bwrap)
    for path in ["/usr/lib", "/usr/lib64", "/lib", "/lib64"]:
        argv += system_bind(path)
    _, binds, hidden = interpreter()
    for path in binds:
        argv += ["--ro-bind", path, path]
    for path in hidden:
        argv += ["--size", "4096", "--tmpfs", path, "--remount-ro", path]
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--size",
        str(scratch_mb << 20),
        "--tmpfs",
        "/box",
        "--chdir",
        "/box",
        "--remount-ro",
        "/",
        "--seccomp",
        str(seccomp_fd),
    ]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return argv + ["--", *command]


# Classic BPF, as in <linux/filter.h> and <linux/seccomp.h>.
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
ALLOW, ERRNO, KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
EPERM, ENOSYS, CLONE_THREAD = 1, 38, 0x00010000
# machine -> (AUDIT_ARCH_*, clone, clone3, syscalls refused with EPERM), from the kernel's
# arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h
SYSCALLS = {
    "x86_64": (0xC000003E, 56, 435, (57, 58, 29)),  # fork, vfork, shmget
    "aarch64": (0xC00000B7, 220, 435, (194,)),  # shmget; there is no fork or vfork
}


@functools.cache
def seccomp_filter(forks: bool = False) -> bytes:
    """The filter as bwrap's --seccomp reads it: an array of struct sock_filter. With `forks`
    (the agent sandbox, whose shell must start processes; RLIMIT_NPROC bounds them there, see
    primerl_sandbox.workspace) only fork's refusal goes: the other ABIs and shmget stay refused."""
    machine = platform.machine()
    if machine not in SYSCALLS:
        raise SandboxUnavailable(f"the code sandbox's seccomp filter knows {sorted(SYSCALLS)}, not {machine}")
    arch, clone, clone3, refused = SYSCALLS[machine]
    program: list = [
        (LD_ABS, 0, 0, 4),  # seccomp_data.arch: another ABI (i386 on x86_64) is killed
        (JEQ, 0, "kill", arch),
        (LD_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":
        program.append((JGE, "eperm", 0, 0x40000000))  # the x32 ABI's numbers
    if forks:
        refused = refused[-1:]  # shmget (the last of each machine's list)
    else:
        program += [(JEQ, "enosys", 0, clone3), (JEQ, "clone", 0, clone)]
    program += [(JEQ, "eperm", 0, nr) for nr in refused]
    program += [
        (RET, 0, 0, ALLOW),
        "clone",
        (LD_ABS, 0, 0, 16),
        (JSET, "allow", "eperm", CLONE_THREAD),  # args[0], low word
        "allow",
        (RET, 0, 0, ALLOW),
        "eperm",
        (RET, 0, 0, ERRNO | EPERM),
        "enosys",
        (RET, 0, 0, ERRNO | ENOSYS),
        "kill",
        (RET, 0, 0, KILL_PROCESS),
    ]
    return _assemble(program)


def _assemble(program: list) -> bytes:
    """Instructions (op, jt, jf, k), with jump targets given as labels (the strings between
    them), to struct sock_filter's bytes: a jump is the count of instructions it skips."""
    labels, code = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(code)
        else:
            code.append(item)

    def offset(target: int | str, at: int) -> int:
        return labels[target] - at - 1 if isinstance(target, str) else target

    return b"".join(struct.pack("=HBBI", op, offset(jt, i), offset(jf, i), k) for i, (op, jt, jf, k) in enumerate(code))


def seccomp_pipe(forks: bool = False) -> int:
    """A pipe's read end holding the filter, for bwrap's --seccomp (the caller closes it)."""
    read, write = os.pipe()
    os.write(write, seccomp_filter(forks))
    os.close(write)
    return read


PROBE = (
    "import os\ntry:\n    pid = os.fork()\nexcept PermissionError:\n    print('ok')\nelse:\n    pid or os._exit(0)\n"
)
_checked: dict[str, str | None] = {}


def require(bwrap: str) -> None:
    """Raise SandboxUnavailable unless the sandbox starts and refuses to fork (probed once)."""
    if bwrap not in _checked:
        _checked[bwrap] = _probe(bwrap)
    if _checked[bwrap] is not None:
        raise SandboxUnavailable(_checked[bwrap])


def _probe(bwrap: str) -> str | None:
    """None if the sandbox works, else why not (with the install hint)."""
    try:
        seccomp = seccomp_pipe()
    except SandboxUnavailable as e:
        return str(e)
    command = [interpreter()[0], "-I", "-S", "-B", "-c", PROBE]
    try:
        proc = subprocess.run(
            bwrap_argv(bwrap, command, seccomp_fd=seccomp, scratch_mb=1),
            pass_fds=(seccomp,),
            env={},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=60,
        )
    except OSError as e:
        return f"the code sandbox needs bubblewrap, and {bwrap!r} cannot be run ({e.strerror}). {INSTALL_HINT}"
    except subprocess.TimeoutExpired:
        return f"bubblewrap ({bwrap}) did not start the code sandbox within 60 s. {INSTALL_HINT}"
    finally:
        os.close(seccomp)
    if proc.returncode != 0 or proc.stdout.strip() != b"ok":
        said = (proc.stderr or proc.stdout).decode(errors="replace").strip()[-500:]
        return (
            f"bubblewrap ({bwrap}) could not start the code sandbox (exit code {proc.returncode}: "
            f"{said or 'no output'}). {INSTALL_HINT}"
        )
    return None
