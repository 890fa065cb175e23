"""Untrusted Python code in a sandbox: the `code_tests` reward and the `python` tool run model-written code here.

`run_in_sandbox(code, tests)` runs `code` (then each test) in a fresh interpreter and returns a `SandboxResult`: how
it ended (`status`), its output (capped), and a pass/fail verdict per test case. What is enforced, and by what:

- A fresh process: `python -I -S -B` (no environment variables read, no site-packages, no .pyc written), started in
  its own session (process group) with an environment of PATH and LANG only (nothing of the driver's, its keys
  included), stdin at /dev/null; it is killed when the process that started it dies (`PR_SET_PDEATHSIG`: a reward
  worker killed at its time limit takes its sandbox with it).
- A temporary private working directory (`tempfile.mkdtemp`, mode 0700), the process's cwd, removed afterwards.
- Kernel resource limits (`setrlimit`, set in the child before the code runs): CPU seconds (`RLIMIT_CPU`: SIGXCPU),
  address space (`RLIMIT_AS`: a `MemoryError`), the size of any file written (`RLIMIT_FSIZE`: SIGXFSZ), open files
  (`RLIMIT_NOFILE`), no core dumps, and no new processes or threads (`RLIMIT_NPROC=0`). The kernel does not apply
  `RLIMIT_NPROC` to root, so a child started as root first gives up root (it becomes `nobody`, 65534, and owns its
  directory); `SandboxResult.isolation["processes"]` says which applies.
- The network: a new, empty network namespace (`unshare(CLONE_NEWNET)`, or with `CLONE_NEWUSER` when unprivileged)
  where the OS allows it: no interface but a downed loopback, so nothing can be reached. Where it does not, only the
  audit hook below refuses sockets; `isolation["network"]` says which (`namespace` or `audit-hook`).
- An audit hook (`sys.addaudithook`, installed before the code runs; it cannot be removed) refuses with a
  `PermissionError`: opening a path outside the working directory (reading the standard library's own files
  excepted, so that imports work), listing, creating, renaming, removing or changing paths outside it, every
  `socket.*` event, `subprocess.Popen`, `os.system`, `os.exec*`, `os.spawn*`, `os.posix_spawn*`, `os.fork`,
  `os.forkpty`, `os.kill*`, `ctypes` (its import and every call), the frame and object introspection that would
  reach the harness (`sys._getframe`, `sys._current_frames`, `gc.get_objects/referrers/referents`, the audited
  attributes `tb_frame`, `gi_frame`, `__code__`, ...), tracing (`sys.settrace`, `sys.setprofile`) and new audit hooks.
  An audit hook is a check inside the interpreter, not a kernel boundary: code that reached native code could pass
  it; the kernel limits above hold whatever the code does.
- A wall-clock limit (`SandboxLimits.wall_s`): the process group is killed (SIGKILL) past it. Output: stdout and
  stderr are read up to `output_bytes` each; more kills the process (`status` `output_limit`).

Not bounded: the total size of many files each under the file-size limit (only time bounds it).

Verdicts: the harness in the child runs the code, then each test case in the code's namespace, and writes each
verdict, tagged with a random token it read from stdin before the code ran, to a pipe of its own; a verdict without
the token, or no verdict (the code exited early, was killed, or closed the pipe), is a fail. A test case is either a
statement (`"assert f(2) == 4"`: passes when it runs without an exception) or `{"call": "f(2)", "expected": 4}`
(passes when the call's value equals the JSON value with the same type: an object that claims to equal everything
does not pass).
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

TestCase = Union[str, dict]


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    wall_s: float = 10.0  # seconds of wall-clock time, then the process group is killed
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_size_mb: float = 1.0  # the largest file the code may write (RLIMIT_FSIZE)
    open_files: int = 32  # RLIMIT_NOFILE
    output_bytes: int = 64 * 1024  # stdout and stderr, each

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_size_mb", "open_files", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)} must be > 0")


# How a run ended. timeout and cpu_limit are the time-outs (`SandboxResult.timed_out`).
STATUSES = ("ok", "error", "timeout", "cpu_limit", "file_size_limit", "output_limit", "killed")


@dataclass
class SandboxResult:
    status: str  # one of STATUSES: ok (exit 0), error (the code raised, exit 1), or what stopped it
    exit_code: Optional[int]
    stdout: str
    stderr: str
    passed: list[bool] = field(default_factory=list)  # per test case
    details: list[str] = field(default_factory=list)  # per test case: "" or why it failed
    seconds: float = 0.0
    isolation: dict[str, str] = field(default_factory=dict)  # what the child enforced (see the module docstring)

    @property
    def timed_out(self) -> bool:
        return self.status in ("timeout", "cpu_limit")

    @property
    def pass_fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0


def _read_roots() -> list[str]:
    """Directories the code may read (not write): the standard library, so that its imports work."""
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths}
    return sorted(roots)


# The child's harness: `python -I -S -B -c _HARNESS`, its job as JSON on stdin. Written for the child only (it reads
# nothing of Relax, which -S and -I keep off its path).
_HARNESS = r'''
def _main():
    import json, math, os, sys
    job = json.loads(sys.stdin.read())
    fd, nonce, write = job["fd"], job["nonce"], os.write
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)

    def say(text):
        try:
            write(fd, (nonce + " " + text.replace("\n", " ")[:400] + "\n").encode())
        except OSError:
            pass

    import ctypes, platform, resource, struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: killed with the process that started it (a reward worker killed
    if os.getppid() != job["parent"]:  # at its time limit), whose wall-clock limit can no longer be enforced
        os._exit(1)
    net, procs = [], []
    if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET
        net.append("namespace")
    elif os.getuid() != 0 and libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
        net.append("namespace")
    work = os.path.realpath(job["dir"])
    os.chdir(work)
    os.umask(0o077)
    lim = job["limits"]
    for what, value in ((resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                        (resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2),
                        (resource.RLIMIT_FSIZE, (int(lim["file_size_mb"] * (1 << 20)),) * 2),
                        (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2),
                        (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_NPROC, (0, 0))):
        resource.setrlimit(what, value)
    # seccomp: the kernel refuses (EPERM) new processes and threads, exec, and sockets, root or not
    syscalls = {"x86_64": (0xC000003E, (56, 57, 58, 59, 322, 435, 41, 53)),  # clone fork vfork execve execveat
                "aarch64": (0xC00000B7, (220, 221, 281, 435, 198, 199))}   # clone3 socket socketpair
    if platform.machine() in syscalls:
        arch, nrs = syscalls[platform.machine()]
        deny = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM
        prog = [(0x20, 0, 0, 4), (0x15, 1, 0, arch), (0x06, 0, 0, deny), (0x20, 0, 0, 0),
                (0x35, len(nrs) + 1, 0, 0x40000000)]  # x32 syscalls: denied
        prog += [(0x15, len(nrs) - i, 0, nr) for i, nr in enumerate(nrs)]
        prog += [(0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, deny)]  # allow; deny
        buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *x) for x in prog))

        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        fprog = Prog(len(prog), ctypes.addressof(buf))
        if libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0:
            procs.append("seccomp")
            net.append("seccomp")
        del buf, fprog, Prog
    del libc
    for m in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.") or m == "_ctypes"]:
        del sys.modules[m]
    if os.getuid() != 0:  # the kernel exempts root from RLIMIT_NPROC
        procs.append("rlimit")
    say("isolation " + json.dumps({"network": "+".join(net + ["audit-hook"]),
                                   "processes": "+".join(procs + ["audit-hook"]), "files": "audit-hook"}))

    roots = tuple(job["read_roots"])
    realpath, fspath, isinstance_, str_, bytes_, hasattr_ = (os.path.realpath, os.fspath, isinstance, str, bytes,
                                                             hasattr)
    inside = lambda p: p == work or p.startswith(work + os.sep)
    readable = lambda p: any(p == r or p.startswith(r + "/") for r in roots)
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    refused = {"subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
               "sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
               "object.__getattr__", "sys.settrace", "sys.setprofile", "sys.addaudithook", "signal.pthread_kill",
               "resource.setrlimit", "resource.prlimit", "os.chroot"}
    refused_prefixes = ("socket.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn")
    paths = {"os.listdir", "os.scandir", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
             "os.link", "os.symlink", "os.truncate", "os.utime", "os.chdir", "os.chflags", "os.mkfifo", "os.mknod",
             "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.copytree", "shutil.move",
             "shutil.rmtree", "shutil.chown", "glob.glob", "os.walk", "os.fwalk", "os.getxattr", "os.listxattr",
             "os.setxattr", "os.removexattr", "pathlib.Path.glob", "pathlib.Path.rglob", "tempfile.mkdtemp",
             "tempfile.mkstemp"}
    listing = {"os.listdir", "os.scandir"}  # the import system lists the standard library's directories
    banned_imports = {"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
    busy = [False]

    class SandboxError(PermissionError, ValueError):  # a ValueError too: the standard library's fallbacks for a refused
        pass                                     # sys._getframe (namedtuple, typing) catch ValueError

    def path_of(p):
        if isinstance_(p, int) or p is None:
            return None
        p = fspath(p)
        return realpath(p.decode() if isinstance_(p, bytes_) else p)

    def hook(event, args):
        if busy[0]:  # the hook's own calls (realpath) raise events too
            return
        busy[0] = True
        try:
            if event == "open":
                p, mode, flags = args
                p = path_of(p)
                if p is None or inside(p):
                    return
                writing = (mode is not None and any(c in mode for c in "wax+")) or (
                    isinstance_(flags, int) and flags & writes)
                if not writing and readable(p):
                    return
                raise SandboxError(f"opening {p!r} (outside the working directory) is refused")
            if event in paths:
                for a in args:
                    if isinstance_(a, (str_, bytes_)) or hasattr_(a, "__fspath__"):
                        p = path_of(a)
                        if not inside(p) and not (event in listing and readable(p)):
                            raise SandboxError(f"{event} on {p!r} (outside the working directory) is "
                                                  "refused")
                return
            if event == "import":
                if args[0] in banned_imports or args[0].split(".")[0] in banned_imports:
                    raise SandboxError(f"importing {args[0]} is refused")
                return
            if event in refused or event.startswith(refused_prefixes):
                raise SandboxError(f"{event} is refused")
        finally:
            busy[0] = False

    tests, code = job["tests"], job["code"]
    del job
    type_, list_, dict_, len_, zip_, float_, all_, repr_, int_ = type, list, dict, len, zip, float, all, repr, int
    exec_, eval_, compile_, enumerate_, base_exception, isclose = exec, eval, compile, enumerate, BaseException, \
        math.isclose
    stderr_write, exit_ = sys.stderr.write, os._exit

    def same(got, want):  # equal and of the same type (an object that equals everything does not pass)
        if type_(want) is float_:
            return type_(got) is float_ and (got == want or isclose(got, want, rel_tol=1e-9, abs_tol=1e-12))
        if type_(want) is list_:
            return type_(got) is list_ and len_(got) == len_(want) and all_(same(g, w) for g, w in zip_(got, want))
        if type_(want) is dict_:
            return type_(got) is dict_ and len_(got) == len_(want) and all_(
                k in want and same(got[k], want[k]) for k in list_(got))
        return type_(got) is type_(want) and got == want

    def describe(e):  # the exception in one line: where in the code (or a test), its type and message
        tb, where = e.__traceback__, "?"
        busy[0] = True  # reading builtin traceback and frame attributes runs no code of the solution's
        try:
            while tb is not None:
                name = tb.tb_frame.f_code.co_filename
                if name.startswith(("<solution", "<test")):
                    where = f"{name[1:-1]}, line {tb.tb_lineno}"
                tb = tb.tb_next
        finally:
            busy[0] = False
        try:
            text = str_(e)[:300]
        except base_exception:
            text = "?"
        return f"{where}: {type_(e).__name__}: {text}"

    sys.addaudithook(hook)
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    failed = None
    try:
        exec_(compile_(code, "<solution>", "exec"), ns)
    except base_exception as e:
        failed = "the code raised: " + describe(e)
        try:
            stderr_write(failed + "\n")
        except base_exception:
            pass
    for i, t in enumerate_(tests):
        if failed is not None:
            say(f"test {i} 0 {failed}")
            continue
        try:
            if isinstance_(t, str_):
                exec_(compile_(t, f"<test {i}>", "exec"), ns)
                ok, why = True, ""
            else:
                got = eval_(compile_(t["call"], f"<test {i}>", "eval"), ns)
                ok = same(got, t["expected"])
                why = "" if ok else "returned " + repr_(got)[:100] + ", expected " + repr_(t["expected"])[:100]
        except base_exception as e:
            ok, why = False, describe(e)
        say(f"test {i} {int_(ok)} {why}")
    say("done")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except base_exception:
        pass
    exit_(1 if failed is not None else 0)


_main()
'''


def run_in_sandbox(code: str, tests: Sequence[TestCase] = (), *,
                   limits: Optional[SandboxLimits] = None) -> SandboxResult:
    """Run `code`, then each test case, in a sandbox (see the module docstring). What the code does never raises
    here: it shows in the result's `status`, output and verdicts."""
    limits = limits or SandboxLimits()
    tests = [_check_test(t, i) for i, t in enumerate(tests)]
    work = tempfile.mkdtemp(prefix="relax-sandbox-")
    nonce = secrets.token_hex(16)
    r, w = os.pipe()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-c", _HARNESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(w,), start_new_session=True, cwd=work,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        job = {"fd": w, "nonce": nonce, "parent": os.getpid(), "code": code, "tests": tests, "dir": work,
               "read_roots": _read_roots(), "limits": {k: getattr(limits, k) for k in
                                                         ("cpu_s", "memory_mb", "file_size_mb", "open_files")}}
        os.close(w)
        w = -1
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:  # the child died before reading its job: its status says how
            pass
        return _collect(proc, r, nonce, len(tests), limits, t0)
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)
        shutil.rmtree(work, ignore_errors=True)


def _check_test(test: Any, i: int) -> TestCase:
    if isinstance(test, str):
        return test
    if isinstance(test, dict) and isinstance(test.get("call"), str) and "expected" in test:
        return {"call": test["call"], "expected": test["expected"]}
    raise ValueError(f"test case {i}: expected a statement (a string) or {{'call': str, 'expected': value}}, "
                     f"got {test!r:.200}")


def _collect(proc: subprocess.Popen, results_fd: int, nonce: str, n_tests: int, limits: SandboxLimits,
             t0: float) -> SandboxResult:
    """Read the child's stdout, stderr and verdicts until it ends, its wall-clock limit passes (its group is
    killed) or its output overflows (killed too)."""
    sel = selectors.DefaultSelector()
    std_fds = (proc.stdout.fileno(), proc.stderr.fileno())
    bufs = {std_fds[0]: bytearray(), std_fds[1]: bytearray(), results_fd: bytearray()}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = t0 + limits.wall_s
    stopped: Optional[str] = None
    open_fds = set(bufs)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            stopped = "timeout"
            break
        for key, _ in sel.select(timeout=left):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(key.fd)
                open_fds.discard(key.fd)
                continue
            bufs[key.fd] += chunk
            if key.fd != results_fd and len(bufs[key.fd]) > limits.output_bytes:
                stopped = "output_limit"
        if stopped:
            break
    if stopped:
        _kill_group(proc)
    sel.close()
    try:
        code = proc.wait(timeout=max(0.1, deadline - time.monotonic()) if not stopped else 5.0)
    except subprocess.TimeoutExpired:  # its pipes closed but it lives on: past the wall-clock limit now
        stopped = "timeout"
        _kill_group(proc)
        code = proc.wait()
    _kill_group(proc)  # nothing of its group outlives it
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    seconds = time.monotonic() - t0
    passed, details, isolation = [False] * n_tests, ["no verdict (the code exited early or was stopped)"] * n_tests, {}
    for line in bytes(bufs[results_fd]).decode(errors="replace").splitlines():
        token, _, rest = line.partition(" ")
        if token != nonce:
            continue
        if rest.startswith("isolation "):
            isolation = json.loads(rest[len("isolation "):])
        elif rest.startswith("test "):
            _, i, ok, why = (rest.split(" ", 3) + [""])[:4]
            if i.isdigit() and int(i) < n_tests:
                passed[int(i)], details[int(i)] = ok == "1", why
    status = stopped or _status(code)
    out, err = (bytes(bufs[fd])[:limits.output_bytes].decode(errors="replace") for fd in std_fds)
    return SandboxResult(status, code, out, err, passed, details, seconds, isolation)


def _status(code: int) -> str:
    if code == 0:
        return "ok"
    if code == -signal.SIGXCPU:  # past RLIMIT_CPU's soft limit (a SIGKILL at its hard limit reads "killed")
        return "cpu_limit"
    if code == -signal.SIGXFSZ:
        return "file_size_limit"
    if code < 0:
        return "killed"
    return "error"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
