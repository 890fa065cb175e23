"""Ways out of the sandbox (relax.rewards.sandbox) found by review, each closed and tested here with a control: the same
operation inside the working directory still works where it should.

The secret files are world-readable in a world-searchable directory, so that when the tests run as root (the child
then runs as nobody) the audit hook, not the file's permissions, is what keeps them out."""

from __future__ import annotations

import os
import shutil
import sysconfig
import tempfile

import pytest

from relax.rewards.sandbox import SandboxLimits, run_in_sandbox

FAST = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mb=256, file_size_mb=1.0, output_bytes=8192)
STDLIB_DIR = os.path.realpath(os.path.join(sysconfig.get_paths()["stdlib"], "encodings"))


def run(code: str, tests=(), limits: SandboxLimits = FAST):
    return run_in_sandbox(code, tests, limits=limits)


@pytest.fixture
def outside():
    """A world-readable directory outside the sandbox with a secret file in it."""
    d = tempfile.mkdtemp(prefix="relax-test-outside-")
    os.chmod(d, 0o777)
    path = os.path.join(d, "secret.txt")
    with open(path, "w") as f:
        f.write("the key")
    os.chmod(path, 0o666)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def deep(n: int = STDLIB_DIR.count("/")) -> str:
    """Code that goes n directories down the working directory and sets `up` to n '..': resolved from the cwd (as the
    audit hook resolves a relative path) `up + path` stays inside the directory; from a directory fd n deep
    (STDLIB_DIR, by default) it is the absolute path."""
    below = "/".join("abcdefghijklmnopqrstuvwxyz"[:n])
    return f"import os\nos.makedirs({below!r}, exist_ok=True)\nos.chdir({below!r})\nup = '../' * {n}\n"


def refused(r, *words):
    return r.status == "error" and "refused" in r.stderr and all(w in r.stderr for w in words)


# -- directory fds: the `open` audit event does not carry dir_fd ------------------------------------------------------

def test_reading_through_a_directory_fd_is_refused(outside):
    """The reviewer's escape: an fd of a standard-library directory, then a relative path with dir_fd."""
    secret = os.path.join(outside, "secret.txt").lstrip("/")
    r = run(deep() + f"d = os.open({STDLIB_DIR!r}, os.O_RDONLY)\n"
            f"print(os.read(os.open(up + {secret!r}, os.O_RDONLY, dir_fd=d), 100))")
    assert refused(r, "opening the directory") and "the key" not in r.stdout, r.stderr
    # the parent's environment (API keys) the same way
    r = run(deep() + f"d = os.open({STDLIB_DIR!r}, os.O_RDONLY)\n"
            "print(os.read(os.open(up + 'proc/%d/environ' % os.getppid(), os.O_RDONLY, dir_fd=d), 100))")
    assert refused(r) and r.stdout == "", r.stderr


def test_writing_through_a_directory_fd_is_refused(outside):
    target = os.path.join(outside, "pwned.txt").lstrip("/")
    r = run(deep() + f"d = os.open({STDLIB_DIR!r}, os.O_RDONLY)\n"
            f"os.write(os.open(up + {target!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d), b'x')")
    assert refused(r) and not os.path.exists(os.path.join(outside, "pwned.txt")), r.stderr


@pytest.mark.parametrize("code", [
    "os.open('.', os.O_RDONLY)",  # a directory of its own: '..' from it leaves the cwd's resolution behind
    "os.mkdir('sub')\nos.open('sub', os.O_RDONLY)",
    "os.mkdir('sub')\nos.open('sub', os.O_RDONLY | os.O_DIRECTORY)",
    "open('f', 'w').close()\nos.open('f', os.O_PATH)",
    "open('.', opener=lambda p, f: os.open(p, f))",
])
def test_no_directory_fd_can_be_had_even_inside_the_directory(code):
    r = run("import os\n" + code)
    assert refused(r, "directory"), r.stderr


def test_files_inside_the_directory_open_by_relative_paths_as_before():
    """The control: paths with '..' that stay inside, files opened for reading, writing and appending."""
    r = run(deep(3) + "open('../../x.txt', 'w').write('a')\nopen('../../x.txt', 'a').write('b')\n"
            "fd = os.open('../y.txt', os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'c')\nos.close(fd)\n"
            "print(open('../../x.txt').read() + open('../y.txt').read())")
    assert r.status == "ok" and r.stdout == "abc\n", r.stderr


@pytest.mark.parametrize("call", [
    "os.mkdir('x', dir_fd=d)", "os.rename('f', 'g', src_dir_fd=d)", "os.rename('f', 'g', dst_dir_fd=d)",
    "os.replace('f', 'g', dst_dir_fd=d)", "os.link('f', 'g', dst_dir_fd=d)", "os.symlink('f', 'g', dir_fd=d)",
    "os.chmod('f', 0o600, dir_fd=d)", "os.chown('f', -1, -1, dir_fd=d)", "os.utime('f', dir_fd=d)",
    "os.remove('f', dir_fd=d)", "os.unlink('f', dir_fd=d)", "os.rmdir('sub', dir_fd=d)",
    "shutil.rmtree('sub', dir_fd=d)",
])
def test_every_audited_call_given_a_directory_fd_is_refused(call):
    """Whatever the fd (no directory fd can be had; any other is refused before the kernel sees it)."""
    r = run(f"import os, shutil\nopen('f', 'w').close()\nos.mkdir('sub')\nd = os.open('f', os.O_RDONLY)\n{call}")
    assert refused(r, "directory fd"), (call, r.stderr)
    # the control: the same call without dir_fd, inside the directory
    plain = call.replace(", dir_fd=d", "").replace(", src_dir_fd=d", "").replace(", dst_dir_fd=d", "")
    r = run(f"import os, shutil\nopen('f', 'w').close()\nos.mkdir('sub')\n{plain}\nprint('done')")
    assert r.status == "ok" and r.stdout == "done\n", (plain, r.stderr)


@pytest.mark.parametrize("call", ["os.fchdir(d)", "os.chdir(d)", "os.listdir(d)", "list(os.scandir(d))"])
def test_changing_to_or_listing_a_directory_by_fd_is_refused(call):
    r = run(f"import os\nopen('f', 'w').close()\nd = os.open('f', os.O_RDONLY)\n{call}")
    assert refused(r, "file descriptor"), (call, r.stderr)


def test_changing_a_file_outside_by_its_fd_is_refused_and_inside_works():
    r = run("import os\nfd = os.open(os.__file__, os.O_RDONLY)\nos.fchmod(fd, 0o777)")
    assert refused(r, "os.chmod"), r.stderr
    r = run("import os\nclass I(int):\n    pass\nfd = os.open(os.__file__, os.O_RDONLY)\nos.fchmod(I(fd), 0o777)")
    assert refused(r, "os.chmod"), r.stderr  # an int subclass is read as its value
    r = run("import os\nfd = os.open('f', os.O_WRONLY | os.O_CREAT, 0o644)\nos.fchmod(fd, 0o600)\n"
            "os.truncate(fd, 0)\nprint(oct(os.stat('f').st_mode & 0o777))")
    assert r.status == "ok" and r.stdout == "0o600\n", r.stderr


def test_the_kernel_refuses_a_directory_fd_where_the_hook_cannot_see_it():
    """os.open(dir_fd=) is not seen by the audit hook (its event lacks dir_fd): the seccomp filter refuses every *at
    call given a directory fd (EPERM, where an fd of a file would give ENOTDIR)."""
    r = run("import os\nfd = os.open('f', os.O_WRONLY | os.O_CREAT)\ntry:\n    os.open('g', os.O_RDONLY, dir_fd=fd)\n"
            "except OSError as e:\n    print(type(e).__name__, e.errno)")
    if "seccomp" not in r.isolation.get("files", ""):
        pytest.skip("no seccomp filter here")
    assert r.status == "ok" and r.stdout == "PermissionError 1\n", (r.stdout, r.stderr)


def test_a_tree_inside_the_directory_can_still_be_removed_copied_and_walked():
    r = run("import os, shutil, glob, pathlib\nos.makedirs('a/b/c')\nopen('a/b/c/f.txt', 'w').write('x')\n"
            "shutil.copytree('a', 'z')\nshutil.rmtree('a')\nprint(sorted(glob.glob('**/*.txt', recursive=True)), "
            "[p for p, _, _ in os.walk('.')], pathlib.Path('z/b/c/f.txt').read_text())")
    assert r.status == "ok", r.stderr
    assert r.stdout == "['z/b/c/f.txt'] ['.', './z', './z/b', './z/b/c'] x\n"


# -- the audit hook runs no code of the program's ---------------------------------------------------------------------

@pytest.mark.parametrize("name,code", [
    # realpath calls os.lstat: the program's own lstat ran inside the hook, with the checks off
    ("os.lstat replaced", "import os\nreal = os.lstat\ndef ev(p):\n    os.lstat = real\n    leak()\n"
                          "    return real(p)\n"
                          "os.lstat = ev\nopen('x', 'w').close()"),
    ("a builtin replaced", "import builtins\nreal = builtins.any\ndef ev(it):\n    builtins.any = real\n    leak()\n"
                           "    return real(it)\nbuiltins.any = ev\nopen('/etc/hostname')"),
    ("the error's __init__", "try:\n    open('/etc/hostname')\nexcept Exception as e:\n    E = type(e)\n"
                             "def init(self, *a):\n    E.__init__ = Exception.__init__\n    leak()\nE.__init__ = init\n"
                             "open('/etc/hostname')"),
    ("a traceback property", "class T:\n    @property\n    def tb_frame(self):\n        leak()\n"
                             "class E(Exception):\n    @property\n    def __traceback__(self):\n        return T()\n"
                             "    @__traceback__.setter\n    def __traceback__(self, v):\n        pass\nraise E()"),
    ("a file name's startswith", "class S(str):\n    def startswith(self, *a):\n        leak()\n        return False\n"
                                 "exec(compile('1/0', S('x'), 'exec'))"),
    ("a path of a str subclass", "class S(str):\n    pass\nprint(open(S(SECRET)).read())"),
    ("a path of a bytes subclass", "import os\nclass B(bytes):\n    pass\n"
                                   "print(os.read(os.open(B(SECRET.encode()), os.O_RDONLY), 100))"),
])
def test_the_hook_runs_no_code_of_the_program(outside, name, code):
    secret = os.path.join(outside, "secret.txt")
    r = run(f"SECRET = {secret!r}\ndef leak():\n    print('LEAK', open(SECRET).read(), flush=True)\n" + code,
            ["assert True"])
    assert "the key" not in r.stdout, (name, r.stdout, r.stderr)


# -- modules that reach files past the hook ---------------------------------------------------------------------------

@pytest.mark.parametrize("code,module", [
    ("import readline\nreadline.add_history('x')\nreadline.write_history_file(TARGET)", "readline"),
    ("import sqlite3\nsqlite3.connect(':memory:').execute(f\"ATTACH DATABASE '{TARGET}' AS x\")", "_sqlite3"),
    ("import tkinter\ntkinter.Tcl().eval(f'close [open {TARGET} w]')", "_tkinter"),
    ("import _posixshmem, os\n_posixshmem.shm_open('/relax-test', os.O_CREAT | os.O_RDWR, 0o600)", "_posixshmem"),
    ("import spwd\nspwd.getspall()", "spwd"),
    ("import importlib\nimportlib.import_module('readline')", "readline"),
])
def test_modules_that_write_files_past_the_hook_are_refused(outside, code, module):
    target = os.path.join(outside, "written")
    r = run(f"TARGET = {target!r}\n" + code)
    assert refused(r, module) and "ImportError" in r.stderr, r.stderr
    assert not os.path.exists(target) and not os.path.exists("/dev/shm/relax-test")


def test_a_refused_optional_import_lets_its_importer_go_on():
    """ssl is refused with an ImportError, which http.client and urllib.request treat as 'no ssl'."""
    r = run("import http.client, urllib.request, json, decimal, sqlite3")
    assert refused(r, "_sqlite3"), r.stderr
    r = run("import http.client, urllib.request, json, decimal, hashlib, zoneinfo\nprint('ok')")
    assert r.status == "ok" and r.stdout == "ok\n", r.stderr


def test_native_code_written_into_the_directory_is_not_imported():
    """An extension module copied in (or written by the program) would run native code, past the hook."""
    r = run("import sys, array\nsrc = open(array.__file__, 'rb').read()\n"
            "open(array.__file__.rsplit('/', 1)[1], 'wb').write(src)\nsys.path.insert(0, '')\n"
            "del sys.modules['array']\nimport array\nprint(array.__file__)")
    assert refused(r, "native code"), (r.stdout, r.stderr)
    r = run("import array, _json, unicodedata\nprint(array.array('i', [1, 2]).tolist())")  # the control
    assert r.status == "ok" and r.stdout == "[1, 2]\n", r.stderr


def test_pidfds_and_fifos_are_refused_by_the_kernel():
    """No audit event covers os.pidfd_open (a signal to any process) or os.mkfifo (a blocking open)."""
    r = run("import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0)")
    if "seccomp" not in r.isolation.get("processes", ""):
        pytest.skip("no seccomp filter here")
    assert r.status == "error" and "Operation not permitted" in r.stderr, r.stderr
    r = run("import os\nos.mkfifo('f')")
    assert r.status == "error" and "Operation not permitted" in r.stderr, r.stderr


# -- the user ---------------------------------------------------------------------------------------------------------

def test_a_child_started_as_root_runs_as_nobody():
    r = run("import os\nopen('f', 'w').write('x')\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups(), "
            "open('f').read())")
    assert r.status == "ok", r.stderr
    if os.geteuid() != 0:
        assert r.isolation["user"] == f"uid {os.getuid()}"
        pytest.skip("not root: the child keeps this user (nothing to give up)")
    assert r.stdout == "65534 65534 65534 [] x\n" and r.isolation["user"] == "nobody", (r.stdout, r.isolation)
    assert "nobody" in r.isolation["files"] and "rlimit" in r.isolation["processes"]


def test_a_child_that_cannot_give_up_root_says_so(monkeypatch):
    """The control of the above: where the driver cannot give the directory to nobody, the child stays root (still
    behind the audit hook and the seccomp filter) and its isolation says so."""
    if os.geteuid() != 0:
        pytest.skip("not root")

    def refuse(*a, **k):
        raise PermissionError("chown refused (test)")

    monkeypatch.setattr(os, "chown", refuse)
    r = run("import os\nprint(os.getuid())")
    assert r.status == "ok" and r.stdout == "0\n" and r.isolation["user"] == "root", (r.stdout, r.isolation)
    assert "rlimit" not in r.isolation["processes"] and "nobody" not in r.isolation["files"]


def test_as_nobody_the_parents_environment_is_unreadable_by_the_kernel_too():
    """Defence in depth: the /proc file (refused by the hook) is also refused by the kernel to another user."""
    if os.geteuid() != 0:
        pytest.skip("not root: the child runs as this user")
    r = run("import os\nprint(os.access('/proc/%d/environ' % os.getppid(), os.R_OK))")
    assert r.status == "ok" and r.stdout == "False\n", (r.stdout, r.stderr)


# -- a program that ignores SIGXCPU -----------------------------------------------------------------------------------

def test_a_program_ignoring_sigxcpu_is_a_cpu_time_out():
    """Ignored SIGXCPU: the kernel's SIGKILL at RLIMIT_CPU's hard limit; counted as a CPU time-out."""
    r = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass", ["assert True"],
            SandboxLimits(wall_s=30.0, cpu_s=1))
    assert r.status == "cpu_limit" and r.timed_out and r.exit_code == -9 and r.passed == [False], r
    # the control: a program killing itself with SIGKILL before its CPU limit is "killed", not a time-out
    r = run("import os, signal\nsignal.raise_signal(signal.SIGKILL)", limits=SandboxLimits(wall_s=30.0, cpu_s=5))
    assert r.status == "killed" and not r.timed_out, r


# -- the harness's own ctypes, from CPython's cache of extension modules ----------------------------------------------

# The tryout's escape (report-tryout-models, item 1): the harness imported ctypes and deleted it from sys.modules, but
# CPython keeps an extension module it loaded in a cache, from which ExtensionFileLoader.create_module returns it with
# no "import" audit event. With _ctypes: memory reads and writes with no audited call, the hook found through a
# refusal's traceback, and its closure cells emptied (CPython 3.11's layouts).
ESCAPE = r'''
import importlib.machinery as m, sysconfig, os
d = sysconfig.get_paths()["stdlib"] + "/lib-dynload"
f = [x for x in os.listdir(d) if x.startswith("_ctypes.")][0]
l = m.ExtensionFileLoader("_ctypes", d + "/" + f)
C = l.create_module(m.ModuleSpec("_ctypes", l, origin=d + "/" + f)); l.exec_module(C)
print("STEP 1 PASSED: _ctypes loaded", flush=True)
class c_void_p(C._SimpleCData): _type_ = "P"
class c_u64(C._SimpleCData): _type_ = "Q"
class U(C.Union): _fields_ = [("v", c_void_p), ("p", C.POINTER(c_u64))]
u = U()
def rd(a): u.v = a; return u.p[0]
def wr(a, x): u.v = a; u.p[0] = x
def ref(a):  # a Python reference to the object at address a
    L = [None]; wr(a, rd(a) + 1); wr(rd(id(L) + 24), a); return L[0]
try:
    open(SECRET)
except Exception as e:
    tb = e.__traceback__
while tb.tb_next is not None:
    tb = tb.tb_next
hook = ref(rd(rd(rd(id(tb) + 24) + 24)))  # tb_frame, its f_frame, its f_func: the hook
for c in hook.__closure__:
    v = c.cell_contents
    if callable(v) and getattr(v, "__name__", "") == "check":
        for c2 in v.__closure__:
            v2 = c2.cell_contents
            if isinstance(v2, str) and v2.startswith("/tmp/"):
                c2.cell_contents = "/"
            if isinstance(v2, tuple) and "socket." in v2:
                c2.cell_contents = ()
            if callable(v2) and getattr(v2, "__name__", "") == "inside":
                for c3 in v2.__closure__:
                    if isinstance(c3.cell_contents, str) and c3.cell_contents.startswith("/"):
                        c3.cell_contents = "/"
print("READ", open(SECRET).read(), flush=True)
open(TARGET, "w").write("written from the sandbox")
print("WROTE", flush=True)
'''


def test_the_harness_ctypes_cannot_be_had_back_from_the_extension_cache(outside):
    """The program's interpreter never loaded _ctypes (the harness's ctypes work is done in a first interpreter that
    execs a fresh one): the extension loader's load is a fresh one, whose "import" event the hook refuses, at the
    escape's first step."""
    secret, target = os.path.join(outside, "secret.txt"), os.path.join(outside, "escaped.txt")
    code = f"SECRET, TARGET = {secret!r}, {target!r}\n" + ESCAPE
    step1 = 1 + next(i for i, line in enumerate(code.splitlines()) if "create_module" in line)
    r = run(code, ["assert True"])
    assert "STEP 1 PASSED" not in r.stdout and "the key" not in r.stdout, (r.stdout, r.stderr)
    assert refused(r, f"line {step1}: SandboxImportError: importing _ctypes is refused"), (r.stdout, r.stderr)
    assert not os.path.exists(target) and r.passed == [False]


def test_the_kernel_lets_only_the_harness_exec_its_second_interpreter(monkeypatch):
    """The seccomp filter lets execve through only with the first stage's own buffer as the path: a second stage
    with no audit hook (a test's stand-in) that execs again, by path (execve) or by fd (execveat), gets EPERM."""
    import relax.rewards.sandbox as sandbox

    monkeypatch.setattr(sandbox, "_STAGE2", (
        "import json, os, sys\nwith open(int(sys.argv[1])) as f:\n    job = json.load(f)\n"
        "print(job['isolation']['processes'], flush=True)\n"
        "for how in ('path', 'fd'):\n    try:\n"
        "        if how == 'path':\n            os.execv(sys.executable, [sys.executable, '-c', 'print(1)'])\n"
        "        os.execve(os.open(sys.executable, os.O_RDONLY), [sys.executable, '-c', 'print(1)'], {})\n"
        "    except OSError as e:\n        print(how, 'refused', e.errno, flush=True)\n"))
    r = run("")
    if "seccomp" not in r.stdout:
        pytest.skip("no seccomp filter here")
    assert r.stdout.splitlines()[1:] == ["path refused 1", "fd refused 1"], (r.stdout, r.stderr)


def test_the_second_stage_runs_no_program_in_an_interpreter_that_loaded_a_refused_module(monkeypatch):
    """Its check at the hook's installation: a second stage that imported ctypes (a stand-in: the harness's own with
    one import more) runs no code and gives no verdict; the control, the harness as it is, runs it."""
    import relax.rewards.sandbox as sandbox

    r = run("print('RAN')", ["assert True"])
    assert r.status == "ok" and r.stdout == "RAN\n" and r.passed == [True], (r.stdout, r.stderr)
    monkeypatch.setattr(sandbox, "_STAGE2", sandbox._STAGE2.replace("def _main():\n", "def _main():\n"
                                                                     "    import ctypes\n", 1))
    r = run("print('RAN')", ["assert True"])
    assert r.status == "error" and r.stdout == "" and r.passed == [False], (r.stdout, r.stderr)
    assert "the sandbox's interpreter has loaded _ctypes, ctypes: the program is not run" in r.stderr, r.stderr


def test_the_program_holds_no_file_descriptor_of_the_harness_but_its_verdict_pipe():
    """The job (with the verdicts' token) reached the program's interpreter in a memfd, closed before the program
    runs: of fds 0-65535, the program has stdin (/dev/null), stdout, stderr and the verdict pipe only (whose number is
    the driver's: past 63 in a test process that opened many)."""
    r = run("import os, stat\nopen_fds = []\nfor i in range(1 << 16):\n    try:\n        m = os.fstat(i).st_mode\n"
            "    except OSError:\n        continue\n    open_fds.append((i, stat.S_ISFIFO(m), stat.S_ISREG(m)))\n"
            "print([x for x in open_fds if x[0] > 2])")
    assert r.status == "ok", r.stderr
    assert r.stdout.count("(") == 1 and ", True, False)" in r.stdout, r.stdout  # one fd past stdio, a pipe


# -- third-party packages -------------------------------------------------------------------------------------------

def test_site_packages_can_be_neither_listed_nor_read_nor_imported():
    """Only the standard library is importable (docs/training.md), also where site-packages is inside the standard
    library's directory (pyenv, any non-venv layout): a pure-Python package installed here, put on sys.path by the
    program, does not import."""
    import importlib.util

    spec = importlib.util.find_spec("packaging")  # the control: installed, pure Python, importable here
    assert spec is not None and spec.origin.endswith(".py")
    site = os.path.dirname(os.path.dirname(spec.origin))
    r = run(f"import sys\nsys.path.append({site!r})\nimport packaging\nprint('IMPORTED', packaging.__file__)")
    assert r.status == "error" and "ModuleNotFoundError: No module named 'packaging'" in r.stderr, (r.stdout, r.stderr)
    r = run(f"import os\nprint(len(os.listdir({site!r})))")
    assert refused(r, "os.listdir", site), (r.stdout, r.stderr)
    r = run(f"print(open({spec.origin!r}).read()[:20])")
    assert refused(r, "opening", spec.origin), (r.stdout, r.stderr)
    r = run("import json, email.parser, collections\nprint('ok')")  # the standard library does
    assert r.status == "ok" and r.stdout == "ok\n", r.stderr
