"""Untrusted Python code in a sandbox: the `code_tests` reward and the `python` tool run model-written code here.

`run_in_sandbox(code, tests)` runs `code` (then each test) in a fresh interpreter and returns a `SandboxResult`: how
it ended (`status`), its output (capped), and a pass/fail verdict per test case. What is enforced, and by what:

- A fresh process: `python -I -S -B` (no environment variables read, no site-packages, no .pyc written), started in
  its own session (process group) with an environment of PATH and LANG only (nothing of the driver's, its keys
  included), stdin at /dev/null; it is killed when the process that started it dies (`PR_SET_PDEATHSIG`: a reward
  worker killed at its time limit takes its sandbox with it). In two stages: the first interpreter sets up what takes
  ctypes (the namespaces, the change of user, the seccomp filter) and execs a second, fresh `python -I -S -B` (the
  namespaces, user, cwd, umask and filter carry over) that sets the limits, installs the audit hook and runs the code.
  The code's interpreter has never loaded ctypes nor any module the hook refuses (it checks so): a module deleted from
  `sys.modules` stays in CPython's cache of extension modules, from which the extension loader would hand it back with
  no `import` audit event. Its job (the verdicts' token) comes in a memfd, closed before the code runs.
- A temporary private working directory (`tempfile.mkdtemp`, mode 0700), the process's cwd, removed afterwards.
- Not root: a child started as root gives up root before the code runs (it becomes `nobody`, 65534, with no groups,
  and owns its directory), so that the kernel's file permissions hold whatever the code does (`/proc/<parent>/environ`
  and root's private files unreadable) and `RLIMIT_NPROC` applies. Where a directory on the way to the interpreter is
  closed to others (`/root`, 0700, holding a pyenv), the child first covers it, in a mount namespace of its own (the
  host's mounts are untouched), with an empty tmpfs into which only the interpreter's directories are bound. Where the
  OS refuses (no mount namespace, no user 65534), the child stays root; `SandboxResult.isolation["user"]` says which.
- Kernel resource limits (`setrlimit`, set in the child before the code runs): CPU seconds (`RLIMIT_CPU`: SIGXCPU, and
  SIGKILL a second later for a program that ignores SIGXCPU: both are the status `cpu_limit`), address space
  (`RLIMIT_AS`: a `MemoryError`), the size of any file written (`RLIMIT_FSIZE`: SIGXFSZ), open files
  (`RLIMIT_NOFILE`), no core dumps, and no new processes or threads (`RLIMIT_NPROC=0`, which the kernel does not apply
  to root); `SandboxResult.isolation["processes"]` says which applies.
- A seccomp filter (x86_64, aarch64; `isolation` names it where it was set up) on which the kernel refuses (EPERM):
  new processes and threads, exec (but the first stage's one execve of the second, told by the address of its path
  buffer, which a program without native code cannot fill), sockets, `fchdir`, `mknod` (FIFOs), pidfds (signals to
  other processes), file handles, and every `*at` system call given a directory fd (`openat`, `mkdirat`, `renameat`,
  `linkat`, `unlinkat`, `fchmodat`, ...: only `AT_FDCWD` passes, so a relative path is resolved from the cwd, as the
  audit hook resolves it).
- The network: a new, empty network namespace (`unshare(CLONE_NEWNET)`, or with `CLONE_NEWUSER` when unprivileged)
  where the OS allows it: no interface but a downed loopback, so nothing can be reached. Where it does not, only the
  audit hook below refuses sockets; `isolation["network"]` says which (`namespace` or `audit-hook`).
- An audit hook (`sys.addaudithook`, installed before the code runs; it cannot be removed) refuses with a
  `PermissionError`: opening a path outside the working directory (reading the standard library's own files
  excepted, so that imports work, but not its site-packages or dist-packages: only the standard library is
  importable), listing, creating, renaming, removing or changing paths outside it (a path is resolved as the kernel
  resolves it: symlinks followed, a relative one from the cwd, which can only be changed to a path inside; `os.stat`
  and the like raise no audit event: the existence, size and times of a file outside can be read); any directory fd
  (opening a directory, `O_DIRECTORY`, `O_PATH`; the `open` event does not carry `dir_fd`, so no directory fd may
  exist), every call given a `dir_fd`, changing to or listing a directory by its fd, changing a file by its fd
  (`fchmod`, `fchown`, `futimens`, `ftruncate`, xattrs) unless it is inside the directory;
  every `socket.*` event, `subprocess.Popen`, `os.system`, `os.exec*`, `os.spawn*`, `os.posix_spawn*`, `os.fork`,
  `os.forkpty`, `os.kill*`, `ctypes` (its import and every call), the frame and object introspection that would
  reach the harness (`sys._getframe`, `sys._current_frames`, `gc.get_objects/referrers/referents`, the audited
  attributes `tb_frame`, `gi_frame`, `__code__`, ...), tracing (`sys.settrace`, `sys.setprofile`) and new audit hooks.
  It refuses with an `ImportError` (optional imports such as `http.client`'s of `ssl` go on without) the modules that
  reach files past it (`readline`'s history files, `_tkinter`'s Tcl, `_sqlite3`'s ATTACH, `_dbm`/`_gdbm`, POSIX
  shared memory and semaphores, `spwd`, `_ssl`'s file loading, test modules) and any extension module from outside
  the standard library (native code written by the program). The hook itself runs no code of the program's: it
  uses only functions captured before the code runs (not `os.path.realpath`, whose module functions the program
  could replace), reads arguments by their exact builtin type, and makes its error after its checks are back on.
  An audit hook is a check inside the interpreter, not a kernel boundary: code that reached native code could pass
  it; the kernel's layers above (nobody, the seccomp filter, the limits) hold whatever the code does.
- A wall-clock limit (`SandboxLimits.wall_s`): the process group is killed (SIGKILL) past it. Output: stdout and
  stderr are read up to `output_bytes` each; more kills the process (`status` `output_limit`).

The disk: each file is at most `file_size_mb` (`RLIMIT_FSIZE`), and the audit hook counts what can take space, each
open of a file for writing (`open`, `os.open`, and so what `shutil` and `tempfile` write) and each directory or link
created: past `files_written` of them it refuses the next, so the code puts at most `files_written x file_size_mb` on
disk in all. Without the seccomp
filter, the audit hook alone refuses directory fds, and `os.mkfifo` and `os.pidfd_open` (no audit events) are
allowed. With no directory fd, what needs one fails: `os.fwalk`, and on the seccomp filter `os.utime` of an fd
(`futimens` is `utimensat` given the fd); `shutil.rmtree` is set to remove a tree by its paths.

Verdicts: the harness in the child runs the code, then each test case in the code's namespace, and writes each
verdict, tagged with a random token it read (its memfd) before the code ran, to a pipe of its own; a verdict without
the token, or no verdict (the code exited early, was killed, or closed the pipe), is a fail. A test case is either a
statement (`"assert f(2) == 4"`: passes when it runs without an exception) or `{"call": "f(2)", "expected": 4}`
(passes when the call's value equals the JSON value with the same type: an object that claims to equal everything
does not pass).

Statement tests are made as hard to fool: each is compiled before the code runs, with every comparison (`==`, `!=`,
`<`, `in`, ..., chained ones pair by pair) rewritten through the AST into the harness's, which compares built-in data
only, as Python compares it (`2 == 2.0` holds, a list never equals a tuple): each side is read by the built-in types'
own methods (a subclass of one, such as a namedtuple, an IntEnum, a Counter or an OrderedDict, by its built-in
content: its fields, its value, its items compared as a dict's), and a value of any other class fails the test
(`NotBuiltinData`) instead of being asked whether it is equal. Truth tests (`assert x`, `not x`, `if`, `while`,
comprehension conditions, the operands of `and`/`or`) take the truth of built-in data the same way, and `all`/`any`
that of each item. `is` and `is not` stay identity. The tests run in globals of their own: the solution's names, and
the builtins as they were before the code ran (a name of a builtin always means the builtin, even where the solution
defines or patches one); the attributes of the modules loaded before the code ran (the harness's imports: `math`,
`re`, `collections`, `functools`, `itertools`, `operator`, ...) are put back before each test. What the code can
still reach: the modules it imports first itself and changes, a predicate it patches between two statements of one
test, and what the test itself computes from its objects by other means (`isinstance`, `math.isclose` read through
`__float__`, `len`): a test should end in a comparison.
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

from relax.sandbox_limits import MEMORY_FLOOR_MB, WALL_FLOOR_S

TestCase = Union[str, dict]


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    wall_s: float = 10.0  # seconds of wall-clock time, then the process group is killed
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    file_size_mb: float = 1.0  # the largest file the code may write (RLIMIT_FSIZE)
    # how many times the code may open a file for writing or create a directory or a link (the audit hook counts
    # them): with file_size_mb, this bounds what it can put on disk in all, files_written x file_size_mb
    files_written: int = 64
    open_files: int = 32  # RLIMIT_NOFILE
    output_bytes: int = 64 * 1024  # stdout and stderr, each

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_size_mb", "files_written", "open_files", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name}={getattr(self, name)} must be > 0")
        # the floors data.sandbox's rules state (relax.sandbox_limits, one owner): below them the sandbox's
        # own interpreter cannot start, so every program would fail before its first line
        if self.memory_mb < MEMORY_FLOOR_MB:
            raise ValueError(f"SandboxLimits.memory_mb={self.memory_mb} is below {MEMORY_FLOOR_MB} MB, the least the "
                             "sandbox allows: its Python interpreter could not start")
        if self.wall_s < WALL_FLOOR_S:
            raise ValueError(f"SandboxLimits.wall_s={self.wall_s} is below {WALL_FLOOR_S:g} s, the least the sandbox "
                             "allows: its interpreter could not start and set up its isolation in time")


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


NOBODY = 65534  # the user (and group) a child started as root becomes


def _read_roots() -> list[str]:
    """Directories the code may read (not write): the standard library, so that its imports work (less
    `_unreadable()`, the third-party packages installed in it)."""
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths}
    return sorted(roots)


def _unreadable() -> list[str]:
    """Directories under the read roots that the code may not read nor list: where third-party packages are
    installed (the interpreter's site-packages, which a pyenv or any non-venv layout keeps inside the standard
    library's directory, and every site-packages or dist-packages there), so that only the standard library is
    importable."""
    paths = sysconfig.get_paths()
    out = {os.path.realpath(paths[k]) for k in ("purelib", "platlib") if k in paths}
    for root in _read_roots():
        try:
            names = os.listdir(root)
        except OSError:
            continue
        out.update(os.path.realpath(os.path.join(root, n)) for n in names if n in ("site-packages", "dist-packages"))
    return sorted(out)


def _exec_paths() -> list[str]:
    """The files the sandbox's second interpreter is started from (the executable, and its shared libpython where
    there is one): a child that becomes nobody makes them reachable, as it does the read roots."""
    out = [os.path.abspath(sys.executable), os.path.realpath(sys.executable)]  # (a venv's: a link to its base's)
    lib = sysconfig.get_config_var("INSTSONAME") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None
    if lib and sysconfig.get_config_var("LIBDIR"):
        path = os.path.realpath(os.path.join(sysconfig.get_config_var("LIBDIR"), lib))
        if os.path.exists(path):
            out.append(path)
    return out


# The child's harness, in two stages, each written for the child only (they read nothing of Relax, which -S and -I keep
# off the path). Stage 1, `python -I -S -B -c _STAGE1`, its job as JSON on stdin: the isolation that takes ctypes
# (namespaces, the change of user, the seccomp filter), then it execs stage 2, `python -I -S -B -c _STAGE2 <fd>`, a
# fresh interpreter that never loaded ctypes (a module deleted from sys.modules stays in CPython's cache of extension
# modules, from which `ExtensionFileLoader.create_module` returns it with no "import" audit event), its job in a
# memfd whose number is its argument, read and closed before the program runs. The seccomp filter lets execve
# through only with the address of stage 1's own buffer holding the interpreter's path as its first argument.
_STAGE1 = r'''
def _main():
    import json, os, sys
    job = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)

    import ctypes, platform, struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    net, procs, files = [], [], []
    if libc.unshare(0x40000000) == 0:  # CLONE_NEWNET
        net.append("namespace")
    elif os.getuid() != 0 and libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
        net.append("namespace")
    work = os.path.realpath(job["dir"])
    nobody = job["nobody"]

    def blocked(path):  # the first directory on `path` that nobody may not search, and its next component
        d = "/"
        for c in path.strip("/").split("/"):
            st = os.stat(d)
            if not st.st_mode & 0o001 and st.st_uid != nobody:
                return d, c
            d = os.path.join(d, c)
        return None

    def reachable(paths):  # makes each of `paths` reachable by nobody, in a mount namespace of its own (the host's
        private = False    # mounts are untouched): a directory nobody may not search (/root, 0700, holding the
        for _ in range(8):  # interpreter) is covered by an empty tmpfs into which only the needed entries are bound
            stops = {}
            for p in paths:
                b = blocked(p)
                if b:
                    stops.setdefault(b[0], set()).add(b[1])
            if not stops:
                for p in paths:  # and each is itself open to nobody (the working directory is nobody's)
                    st = os.stat(p)
                    if st.st_mode & 0o005 != 0o005 and st.st_uid != nobody:
                        raise OSError(f"{p} is not readable by nobody")
                return
            if blocked(work) or "/" in stops:
                raise OSError("the working directory or / is not reachable by nobody")
            if not private:
                if libc.unshare(0x00020000) != 0 or libc.mount(None, b"/", None, 0x4000 | 0x40000, None) != 0:
                    raise OSError("no mount namespace")  # CLONE_NEWNS; MS_REC | MS_PRIVATE
                private = True
            for d, names in stops.items():
                fds = {n: os.open(os.path.join(d, n), os.O_PATH) for n in names}
                if libc.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4, b"mode=755,size=64k") != 0:  # NOSUID | NODEV
                    raise OSError("tmpfs")
                for n, f in fds.items():
                    os.mkdir(os.path.join(d, n))
                    if libc.mount(f"/proc/self/fd/{f}".encode(), os.path.join(d, n).encode(), None, 0x1000 | 0x4000,
                                  None) != 0:  # MS_BIND | MS_REC
                        raise OSError("bind")
                    os.close(f)
        raise OSError("too deep")

    user = "uid %d" % os.getuid()
    if os.getuid() == 0:  # the kernel exempts root from RLIMIT_NPROC and root reads every file: become nobody
        user = "root"
        if nobody is not None:
            try:
                reachable(job["read_roots"] + job["exec_paths"] + [work])
                os.setgroups([])
                os.setgid(nobody)
                os.setuid(nobody)
                user = "nobody"
            except OSError:
                if os.getuid() == 0 and os.getgid() != 0:
                    os.setgid(0)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL (set after the change of user, which clears it): killed with the
    if os.getppid() != job["parent"]:  # process that started it (a reward worker killed at its time limit), whose
        os._exit(1)                    # wall-clock limit can no longer be enforced
    os.chdir(work)
    os.umask(0o077)
    # seccomp: the kernel refuses (EPERM), root or not: new processes and threads, exec (but stage 1's own execve of
    # stage 2: its first argument the address of `exe`, which a program without ctypes cannot fill), sockets,
    # fchdir, FIFOs and device nodes, pidfds (signals to other processes), file handles, and every *at call given a
    # directory fd (only AT_FDCWD passes: a path is then resolved as the audit hook resolves it, from the cwd)
    exe = ctypes.create_string_buffer(os.fsencode(job["python"]))
    exe_at = ctypes.addressof(exe)
    syscalls = {
        # clone fork vfork execveat clone3 socket socketpair fchdir mknod mknodat pidfd_open
        # pidfd_send_signal pidfd_getfd name_to_handle_at open_by_handle_at; execve
        "x86_64": (0xC000003E, (56, 57, 58, 322, 435, 41, 53, 81, 133, 259, 434, 424, 438, 303, 304), 59,
                   # openat openat2 mkdirat fchownat futimesat unlinkat renameat linkat symlinkat fchmodat
                   # utimensat renameat2 fchmodat2: (number, the arguments that are directory fds)
                   ((257, (0,)), (437, (0,)), (258, (0,)), (260, (0,)), (261, (0,)), (263, (0,)), (264, (0, 2)),
                    (265, (0, 2)), (266, (1,)), (268, (0,)), (280, (0,)), (316, (0, 2)), (452, (0,)))),
        "aarch64": (0xC00000B7, (220, 281, 435, 198, 199, 50, 33, 434, 424, 438, 264, 265), 221,
                    ((56, (0,)), (437, (0,)), (34, (0,)), (54, (0,)), (35, (0,)), (38, (0, 2)), (37, (0, 2)),
                     (36, (1,)), (53, (0,)), (88, (0,)), (276, (0, 2)), (452, (0,))))}
    if platform.machine() in syscalls:
        arch, denied, execve, dirfd_calls = syscalls[platform.machine()]
        code = [("ld", 4), ("jeq", arch, None, "deny"), ("ld", 0), ("jge", 0x40000000, "deny", None)]  # x32: denied
        code += [("jeq", nr, "deny", None) for nr in denied]
        # execve: its pathname argument (both 32-bit halves) is `exe`'s address, or denied
        code += [("jeq", execve, None, "not_execve"), ("ld", 16), ("jeq", exe_at & 0xFFFFFFFF, None, "deny"),
                 ("ld", 20), ("jeq", exe_at >> 32, None, "deny"), ("ret", 0x7FFF0000), ("label", "not_execve")]
        for i, (nr, args) in enumerate(dirfd_calls):
            code.append(("jeq", nr, None, f"next{i}"))
            for a in args:  # the low 32 bits of the argument (the kernel reads an int): AT_FDCWD or denied
                code += [("ld", 16 + 8 * a), ("jeq", 0xFFFFFF9C, None, "deny")]
            code += [("ret", 0x7FFF0000), ("label", f"next{i}")]
        code += [("ret", 0x7FFF0000), ("label", "deny"), ("ret", 0x00050000 | 1)]  # allow; SECCOMP_RET_ERRNO|EPERM
        at, n = {}, 0
        for ins in code:
            if ins[0] == "label":
                at[ins[1]] = n
            else:
                n += 1
        prog, n = [], 0
        for ins in code:
            if ins[0] == "label":
                continue
            jump = lambda label: 0 if label is None else at[label] - n - 1
            if ins[0] == "ld":
                prog.append((0x20, 0, 0, ins[1]))  # BPF_LD | BPF_W | BPF_ABS
            elif ins[0] == "ret":
                prog.append((0x06, 0, 0, ins[1]))
            else:
                prog.append((0x15 if ins[0] == "jeq" else 0x35, jump(ins[2]), jump(ins[3]), ins[1]))
            n += 1
        buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *x) for x in prog))

        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        fprog = Prog(len(prog), ctypes.addressof(buf))
        if libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0:
            procs.append("seccomp")
            net.append("seccomp")
            files.append("seccomp")
    if user == "nobody":  # the kernel's file permissions: a root-owned file reads as for any user
        files.insert(0, "nobody")
    # stage 2: a fresh interpreter (rlimits, namespaces, user, cwd, umask, the seccomp filter and PR_SET_PDEATHSIG
    # hold across the exec), its job (the nonce) in a memfd it reads and closes before the program runs
    stage2 = job.pop("stage2")
    job["dir"], job["isolation"] = work, {"network": net, "processes": procs, "files": files, "user": user}
    mem = os.memfd_create("relax-sandbox-job", 0)
    os.write(mem, json.dumps(job).encode())
    os.lseek(mem, 0, os.SEEK_SET)
    os.set_inheritable(mem, True)
    del job
    args = [exe_at] + [ctypes.c_char_p(os.fsencode(a)) for a in ("-I", "-S", "-B", "-c", stage2, str(mem))]
    argv = (ctypes.c_void_p * (len(args) + 1))(*[a if type(a) is int else ctypes.cast(a, ctypes.c_void_p).value
                                                  for a in args], None)
    env = [ctypes.c_char_p(os.fsencode(k) + b"=" + os.fsencode(v)) for k, v in os.environ.items()]
    envp = (ctypes.c_void_p * (len(env) + 1))(*[ctypes.cast(e, ctypes.c_void_p).value for e in env], None)
    libc.execve.argtypes = [ctypes.c_void_p] * 3
    libc.execve(exe_at, argv, envp)
    os.write(2, ("the sandbox could not start its interpreter: %s\n" % os.strerror(ctypes.get_errno())).encode())
    os._exit(1)


_main()
'''

_STAGE2 = r'''
def _main():
    import json, math, os, resource, stat, sys
    with open(int(sys.argv[1]), "rb") as f:  # the job stage 1 wrote (and the memfd closed: nothing else holds it)
        job = json.loads(f.read())
    del sys.argv[1:]
    fd, nonce, write = job["fd"], job["nonce"], os.write
    work, lim, isolation = job["dir"], job["limits"], job["isolation"]
    net, procs, files, user = (isolation[k] for k in ("network", "processes", "files", "user"))

    def say(text):
        try:
            write(fd, (nonce + " " + text.replace("\n", " ")[:400] + "\n").encode())
        except OSError:
            pass

    for what, value in ((resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                        (resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2),
                        (resource.RLIMIT_FSIZE, (int(lim["file_size_mb"] * (1 << 20)),) * 2),
                        (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2),
                        (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_NPROC, (0, 0))):
        resource.setrlimit(what, value)
    if os.getuid() != 0:  # the kernel exempts root from RLIMIT_NPROC
        procs.append("rlimit")
    import shutil  # its rmtree without directory fds (refused below): a tree in the working directory can be removed
    shutil._use_fd_functions = False
    say("isolation " + json.dumps({"network": "+".join(net + ["audit-hook"]),
                                   "processes": "+".join(procs + ["audit-hook"]),
                                   "files": "+".join(files + ["audit-hook"]), "user": user}))

    # The audit hook runs no code of the program's: it uses only the C functions and constants captured here (the
    # program could replace a module's function, a builtin, or a method of a Python class, and the hook would call
    # it with the checks off) and reads only arguments of exact builtin types (str, bytes, int, None); the error is
    # made after the checks are back on.
    roots, unreadable = tuple(job["read_roots"]), tuple(job["unreadable"])
    work_ = work + "/"
    lstat_, readlink_, getcwd_, fstat_ = os.lstat, os.readlink, os.getcwd, os.stat
    str_, bytes_, int_, type_, tuple_, tlen_, issubclass_ = str, bytes, int, type, tuple, tuple.__len__, issubclass
    base_exception, oserror_ = BaseException, OSError
    s_ifmt, s_iflnk, s_ifdir = stat.S_IFMT(0o170000), stat.S_IFLNK, stat.S_IFDIR
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    no_dir = getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_PATH", 0)  # an fd of a directory is refused
    refused = {"subprocess.Popen", "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
               "sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
               "object.__getattr__", "sys.settrace", "sys.setprofile", "sys.addaudithook", "signal.pthread_kill",
               "resource.setrlimit", "resource.prlimit", "os.chroot", "os.mkfifo", "os.mknod",
               "sqlite3.connect", "sqlite3.enable_load_extension", "sqlite3.load_extension"}
    refused_prefixes = ("socket.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn")
    # events on paths: (the positions of the path arguments, of the directory-fd arguments). Every str or bytes
    # argument is a path; a path given as an fd must be a file in the working directory, a dir_fd must be none.
    paths = {"os.listdir": ((0,), ()), "os.scandir": ((0,), ()), "os.chdir": ((0,), ()), "os.remove": ((0,), (1,)),
             "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
             "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)), "os.symlink": ((0, 1), (2,)),
             "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "os.chflags": ((0,), ()),
             "os.getxattr": ((0,), ()), "os.listxattr": ((0,), ()), "os.setxattr": ((0,), ()),
             "os.removexattr": ((0,), ()), "shutil.copyfile": ((), ()), "shutil.copymode": ((), ()),
             "shutil.copystat": ((), ()), "shutil.copytree": ((), ()), "shutil.move": ((), ()),
             "shutil.rmtree": ((), (1,)), "shutil.chown": ((), ()), "glob.glob": ((), ()), "glob.glob/2": ((), (3,)),
             "os.walk": ((), ()), "os.fwalk": ((), (4,)), "pathlib.Path.glob": ((), ()),
             "pathlib.Path.rglob": ((), ()), "tempfile.mkdtemp": ((), ()), "tempfile.mkstemp": ((), ())}
    by_fd = {"os.chmod", "os.chown", "os.utime", "os.truncate", "os.getxattr", "os.listxattr", "os.setxattr",
             "os.removexattr"}  # these may name a file by an fd (fchmod, ...); listing or chdir by an fd is refused
    listing = {"os.listdir", "os.scandir"}  # the import system lists the standard library's directories
    # modules that reach files (or more) past the hook: readline's history files, Tcl, SQLite's ATTACH, the dbm
    # libraries, POSIX shared memory and semaphores, the shadow file, OpenSSL's file loading, test modules
    banned_imports = {"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "readline", "_tkinter",
                      "_sqlite3", "_dbm", "_gdbm", "_posixshmem", "_multiprocessing", "spwd", "nis", "syslog",
                      "ossaudiodev", "_curses", "_curses_panel", "_ssl", "_xxtestfuzz", "xxlimited", "xxlimited_35",
                      "posix"}
    busy = [False]
    created, most_created = [0], lim["files_written"]
    creating = {"os.mkdir", "os.symlink", "os.link"}  # entries that take space but no open (tempfile's: os.mkdir)

    def count_created(what):  # why one more file written or entry created is refused, or None
        created[0] += 1
        if created[0] <= most_created:
            return None
        return (f"{what}: the code may open files for writing or create directories and links {most_created} times "
                f"(SandboxLimits.files_written, a run's data.sandbox.files_written; each file at most file_size_mb), "
                "and that was all of them")

    def inside(p):
        return p == work or p.startswith(work_)

    def readable(p):  # under the standard library, not under its site-packages
        for u in unreadable:
            if p == u or p.startswith(u + "/"):
                return False
        for r in roots:
            if p == r or p.startswith(r + "/"):
                return True
        return False

    def exact(a):  # a str, bytes or int argument (of a subclass too: a str subclass names its file) as its exact
        t = type_(a)  # type, by the builtin methods (never the subclass's); anything else as it is
        if t is str_ or t is bytes_ or t is int_:
            return a
        if issubclass_(t, str_):
            return str_.__str__(a)
        if issubclass_(t, bytes_):
            return bytes_.__bytes__(a)
        if issubclass_(t, int_):
            return int_.__index__(a)
        return a

    def text(a):  # a path argument (exact) as a str; None when it is not a str or bytes
        t = type_(a)
        if t is str_:
            return a
        if t is bytes_:
            return a.decode("utf-8", "surrogateescape")
        return None

    def resolve(p):  # os.path.realpath (non-strict) from the captured functions: symlinks followed as the kernel does
        if not p.startswith("/"):
            p = getcwd_() + "/" + p
        done, todo, links = [], p.split("/")[::-1], 0
        while todo:
            c = todo.pop()
            if c == "" or c == ".":
                continue
            if c == "..":
                if done:
                    done.pop()
                continue
            here = "/" + "/".join(done + [c])
            try:
                mode = lstat_(here).st_mode
            except oserror_:
                mode = 0
            if mode & s_ifmt != s_iflnk:
                done.append(c)
                continue
            links += 1
            if links > 40:
                raise oserror_("too many symbolic links")
            target = readlink_(here)
            if target.startswith("/"):
                done = []
            todo += target.split("/")[::-1]
        return "/" + "/".join(done)

    def is_dir(p):
        try:
            return fstat_(p).st_mode & s_ifmt == s_ifdir
        except oserror_:
            return False

    def check(event, args):  # why `event` is refused, or None
        args = tuple_([exact(a) for a in args])
        if event == "open":
            p, mode, flags = args
            if type_(flags) is int_ and flags & no_dir:
                return "opening a directory (O_DIRECTORY, O_PATH) is refused"
            if type_(p) is int_:  # open(fd): an fd the program has
                return None
            p = text(p)
            if p is None:
                return "opening something other than a path or an fd is refused"
            p = resolve(p)
            if is_dir(p):
                return f"opening the directory {p!r} is refused"
            writing = (type_(mode) is str_ and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or (
                type_(flags) is int_ and flags & writes)
            if inside(p):
                return count_created(f"opening {p!r} for writing") if writing else None
            if not writing and readable(p):
                return None
            return f"opening {p!r} (outside the working directory) is refused"
        if event in paths:
            at, dir_fds = paths[event]
            n = tlen_(args)
            for i in dir_fds:
                d = args[i] if i < n else None
                if not (d is None or (type_(d) is int_ and (d == -1 or d == -100))):  # none, or AT_FDCWD
                    return f"{event} with a directory fd (dir_fd) is refused"
            for i in at:
                a = args[i] if i < n else None
                if type_(a) is int_:
                    if event not in by_fd:
                        return f"{event} on a file descriptor is refused"
                    p = resolve(f"/proc/self/fd/{a}")
                    if not inside(p):
                        return f"{event} on {p!r} (outside the working directory) is refused"
                elif a is not None and text(a) is None:
                    return f"{event} on something other than a path or an fd is refused"
            for a in args:
                p = text(a)
                if p is not None:
                    p = resolve(p)
                    if not inside(p) and not (event in listing and readable(p)):
                        return f"{event} on {p!r} (outside the working directory) is refused"
            return count_created(event) if event in creating else None
        if event == "import":
            name = text(args[0]) or ""
            for part in name.split("."):
                if part in banned_imports or part.startswith("_test"):
                    return f"importing {name} is refused"
            where = text(args[1]) if tlen_(args) > 1 else None  # an extension module's file: the standard library's
            if where is not None and not readable(resolve(where)):
                return f"importing {name} from {where!r} (native code outside the standard library) is refused"
            return None
        if event in refused or event.startswith(refused_prefixes):
            return f"{event} is refused"
        return None

    class SandboxError(PermissionError, ValueError):  # a ValueError too: the standard library's fallbacks for a refused
        pass                                     # sys._getframe (namedtuple, typing) catch ValueError

    class SandboxImportError(ImportError):  # an ImportError: the standard library's optional imports (ssl) go on
        pass

    def hook(event, args):
        if busy[0] or type_(event) is not str_ or type_(args) is not tuple_:  # the hook's own calls raise events
            return                                   # too; sys.audit() from the program with other types does nothing
        busy[0] = True
        try:
            why = check(event, args)
        except base_exception:
            why = f"{event} (unchecked) is refused"
        finally:
            busy[0] = False
        if why is not None:
            raise (SandboxImportError if event == "import" else SandboxError)(why)

    tests, code = job["tests"], job["code"]
    del job
    list_, dict_, len_, zip_, float_, all_, repr_, isinstance_ = list, dict, len, zip, float, all, repr, isinstance
    exec_, eval_, compile_, enumerate_, isclose = exec, eval, compile, enumerate, math.isclose
    try:
        raise ValueError
    except ValueError as x:
        tb_type = type_(x.__traceback__)
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
        if type_(tb) is not tb_type:  # a property of the program's exception class
            tb = None
        busy[0] = True  # reading builtin traceback and frame attributes runs no code of the solution's (a file name
        try:            # that is not an exact str, given to compile() by the program, is not read)
            while tb is not None:
                name = tb.tb_frame.f_code.co_filename
                if type_(name) is str_ and name.startswith(("<solution", "<test")):
                    where = f"{name[1:-1]}, line {tb.tb_lineno}"
                tb = tb.tb_next
        finally:
            busy[0] = False
        try:
            text = str_(e)[:300]
        except base_exception:
            text = "?"
        return f"{where}: {type_(e).__name__}: {text}"

    # Statement tests: compiled now, before the code runs (nothing of the code's can change how), with each comparison
    # and truth test rewritten to read built-in data only (see `checked` below), and run in globals of their own: the
    # solution's names, but the builtins as they were before the code ran (a name of a builtin is always the builtin)
    import ast, builtins
    from collections import deque as deque_
    dict_items, list_iter, tuple_iter = dict.items, list.__iter__, tuple.__iter__
    set_iter, frozenset_iter, deque_iter = set.__iter__, frozenset.__iter__, deque_.__iter__
    set_, frozenset_, bool_, bytearray_ = set, frozenset, bool, bytearray
    int_copy, float_copy, str_copy, bytes_copy = int.__index__, float.__float__, str.__str__, bytes.__bytes__
    type_name = type.__dict__["__name__"].__get__
    atoms = (type_(None), bool_, int_, float_, complex, str_, bytes_, bytearray_, range, type_(...),
             type_(NotImplemented), type_)  # compared by their built-in methods (a class by identity)
    containers = (list_, tuple_, dict_, set_, frozenset_, deque_)
    pristine = dict_(builtins.__dict__)
    builtin_names = frozenset(pristine)
    module_type = type_(sys)
    modules = sys.modules
    kept_modules = dict_(modules)  # the modules loaded so far, and their attributes: put back before each test
    kept_attrs = [(m.__dict__, dict_(m.__dict__)) for m in kept_modules.values() if type_(m) is module_type]

    class NotBuiltinData(TypeError):
        pass

    def data(v):  # `v` as built-in data, read by the built-in types' own methods (never a method of v's class)
        t = type_(v)
        for a in atoms:
            if t is a:
                return v
        if t is list_ or t is tuple_ or t is set_ or t is frozenset_ or t is deque_ or t is dict_:
            pass
        elif issubclass_(t, int_):  # (an IntEnum, ...: its value)
            return int_copy(v)
        elif issubclass_(t, float_):
            return float_copy(v)
        elif issubclass_(t, str_):
            return str_copy(v)
        elif issubclass_(t, bytes_):
            return bytes_copy(v)
        elif not (issubclass_(t, list_) or issubclass_(t, tuple_) or issubclass_(t, dict_) or issubclass_(t, set_)
                  or issubclass_(t, frozenset_) or issubclass_(t, deque_)):
            raise NotBuiltinData(f"a value of type {type_name(t)} in a comparison or truth test; tests compare and "
                                 "test built-in data only (None, bool, int, float, complex, str, bytes, list, tuple, "
                                 "dict, set, ...)")
        if issubclass_(t, list_):
            return [data(x) for x in list_iter(v)]
        if issubclass_(t, tuple_):  # (a namedtuple: its fields)
            return tuple_([data(x) for x in tuple_iter(v)])
        if issubclass_(t, dict_):  # (OrderedDict, defaultdict, Counter: their items, compared as a dict's)
            return {data(k): data(x) for k, x in dict_items(v)}
        if issubclass_(t, set_):
            return set_([data(x) for x in set_iter(v)])
        if issubclass_(t, frozenset_):
            return frozenset_([data(x) for x in frozenset_iter(v)])
        return deque_([data(x) for x in deque_iter(v)])

    def compare(ops, *values):  # a comparison (chained: each pair) of built-in data, as Python compares it
        left = values[0]
        for j, op in enumerate_(ops):
            right = values[j + 1]
            if op == "is":
                ok = left is right
            elif op == "is not":
                ok = left is not right
            else:
                a, b = data(left), data(right)
                ok = (a == b if op == "==" else a != b if op == "!=" else a < b if op == "<" else a <= b if op == "<="
                      else a > b if op == ">" else a >= b if op == ">=" else a in b if op == "in" else a not in b)
            if not ok:
                return False
            left = right
        return True

    def plain(v):  # an operand of `and` / `or`: its value, when its truth is the built-in one
        t = type_(v)
        for a in atoms + containers:
            if t is a:
                return v
        return data(v)

    def truth(v):
        return bool_(plain(v))

    def all_checked(values):
        for v in values:
            if not truth(v):
                return False
        return True

    def any_checked(values):
        for v in values:
            if truth(v):
                return True
        return False

    fresh = dict_(pristine)
    fresh["all"], fresh["any"] = all_checked, any_checked
    symbols = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.In: "in",
               ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}

    class Checked(ast.NodeTransformer):  # a == b -> __relax_compare__(("==",), a, b); assert x -> assert
        def call(self, name, args, node):  # __relax_truth__(x); `a or b`: each operand through __relax_plain__
            return ast.copy_location(ast.Call(ast.Name(name, ast.Load()), args, []), node)

        def visit_Compare(self, node):
            self.generic_visit(node)
            ops = ast.Constant(tuple([symbols[type(op)] for op in node.ops]))
            return self.call("__relax_compare__", [ops, node.left] + node.comparators, node)

        def tested(self, node):
            self.generic_visit(node)
            node.test = self.call("__relax_truth__", [node.test], node.test)
            return node

        visit_Assert = visit_If = visit_While = visit_IfExp = tested

        def visit_BoolOp(self, node):
            self.generic_visit(node)
            node.values = [self.call("__relax_plain__", [v], v) for v in node.values]
            return node

        def visit_UnaryOp(self, node):
            self.generic_visit(node)
            if isinstance(node.op, ast.Not):
                node.operand = self.call("__relax_truth__", [node.operand], node.operand)
            return node

        def visit_comprehension(self, node):
            self.generic_visit(node)
            node.ifs = [self.call("__relax_truth__", [c], c) for c in node.ifs]
            return node

    compiled = []
    for i, t in enumerate_(tests):
        try:
            if isinstance_(t, str_):
                tree = ast.fix_missing_locations(Checked().visit(ast.parse(t, f"<test {i}>", "exec")))
                compiled.append(compile_(tree, f"<test {i}>", "exec"))
            else:
                compiled.append(compile_(t["call"], f"<test {i}>", "eval"))
        except base_exception as e:
            compiled.append("the test does not compile: " + describe(e))
    harness = {"__relax_compare__": compare, "__relax_truth__": truth, "__relax_plain__": plain}

    # this interpreter never loaded a banned module (nothing here deletes one from sys.modules: absent is never
    # loaded), so none can come back from the extension cache; posix is the os module's, built in, loaded at start
    loaded = sorted(m for m in banned_imports if m in sys.modules and m != "posix")
    if loaded:
        stderr_write("the sandbox's interpreter has loaded " + ", ".join(loaded) + ": the program is not run\n")
        exit_(1)
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
    tg = {"__name__": "__main__"}  # the tests' globals
    for i, t in enumerate_(tests):
        if failed is not None:
            say(f"test {i} 0 {failed}")
            continue
        if type_(compiled[i]) is str_:
            say(f"test {i} 0 {compiled[i]}")
            continue
        try:
            for name, m in dict_items(kept_modules):  # what the code changed in modules loaded before it ran
                if modules.get(name) is not m:
                    modules[name] = m
            for d, attrs in kept_attrs:
                for k, v in dict_items(attrs):
                    if d.get(k) is not v:
                        d[k] = v
            for k, v in list_(dict_items(ns)):
                if type_(k) is str_ and k not in builtin_names and k != "__builtins__":
                    tg[k] = v
            tg["__builtins__"] = fresh
            tg.update(harness)
            if isinstance_(t, str_):
                exec_(compiled[i], tg)
                ok, why = True, ""
            else:
                got = eval_(compiled[i], tg)
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
    nobody = None
    if os.geteuid() == 0:  # the child gives up root: its directory is nobody's
        try:
            os.chown(work, NOBODY, NOBODY)
            nobody = NOBODY
        except OSError:
            pass
    nonce = secrets.token_hex(16)
    r, w = os.pipe()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", "-c", _STAGE1], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(w,), start_new_session=True, cwd=work,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        job = {"fd": w, "nonce": nonce, "parent": os.getpid(), "code": code, "tests": tests, "dir": work,
               "nobody": nobody, "read_roots": _read_roots(), "unreadable": _unreadable(), "python": sys.executable,
               "exec_paths": _exec_paths(), "stage2": _STAGE2, "limits": {k: getattr(limits, k) for k in
                                                         ("cpu_s", "memory_mb", "file_size_mb", "files_written",
                                                          "open_files")}}
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
    code, cpu = _wait(proc, max(0.1, deadline - time.monotonic()) if not stopped else 5.0)
    if code is None:  # its pipes closed but it lives on: past the wall-clock limit now
        stopped = "timeout"
        _kill_group(proc)
        code, cpu = _wait(proc, None)
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
    status = stopped or _status(code, cpu, limits)
    out, err = (bytes(bufs[fd])[:limits.output_bytes].decode(errors="replace") for fd in std_fds)
    return SandboxResult(status, code, out, err, passed, details, seconds, isolation)


def _wait(proc: subprocess.Popen, timeout: Optional[float]) -> tuple[Optional[int], float]:
    """The child's exit code (None: still running after `timeout` seconds) and the CPU seconds it used."""
    end = None if timeout is None else time.monotonic() + timeout
    pause = 0.001
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if end is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() >= end:
            return None, 0.0
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _status(code: int, cpu_s: float = 0.0, limits: Optional[SandboxLimits] = None) -> str:
    if code == 0:
        return "ok"
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and limits is not None and cpu_s >= limits.cpu_s):
        return "cpu_limit"  # past RLIMIT_CPU's soft limit (SIGXCPU), or its hard one (SIGKILL: SIGXCPU was ignored)
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
