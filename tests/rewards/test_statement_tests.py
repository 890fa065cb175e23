"""Statement tests (`"assert f(2) == 10"`, the MBPP/HumanEval form) are as hard to fool as the call form: an object
that claims to equal (or be less than, or be true) everything fails, patched builtins and module functions do not
reach the tests, and honest solutions, including ones Python's `==` accepts across types (240.0 == 240) or that
return a namedtuple or a Counter, still pass."""

from __future__ import annotations

import json

import pytest

from relax.rewards.code_tests import code_tests_reward
from relax.rewards.sandbox import SandboxLimits, run_in_sandbox

FAST = SandboxLimits(wall_s=5.0, cpu_s=3)

# an object that answers every comparison and truth test as the test wants, and survives arithmetic and abs()
LIAR = """
class A:
    def __eq__(self, o): return True
    def __ne__(self, o): return False
    def __lt__(self, o): return True
    def __le__(self, o): return True
    def __gt__(self, o): return True
    def __ge__(self, o): return True
    def __bool__(self): return True
    def __contains__(self, o): return True
    def __hash__(self): return 0
    def __sub__(self, o): return self
    def __abs__(self): return self
    def __float__(self): return 0.0
def f(x):
    return A()
"""
# the same, and builtins, module functions and names of builtins in its own namespace made to agree
PATCHER = LIAR + """
import builtins, math
builtins.abs = lambda x: 0
builtins.all = builtins.any = builtins.isinstance = lambda *a: True
math.isclose = lambda *a, **k: True
abs = lambda x: 0
all = lambda x: True
"""
TESTS = ["assert f(2) == 10", "assert f(2) != 11", "assert f(2) < 11", "assert abs(f(2) - 10) < 1e-6",
         "assert f(2)", "assert not (f(2) != 10)", "assert f(2) and f(2) == 10", "assert all([f(2)])",
         "assert any([f(2), f(3)])", "assert 3 in f(2)", "assert f(2) in [10]", "assert f(2) == 10, 'f(2)'",
         "assert math.isclose(f(2), 10)",
         "r = f(2)\nassert r == 10", "assert [f(2)] == [10]", "assert {'a': f(2)} == {'a': 10}",
         "assert 0 < f(2) < 20", "assert (f(2) if f(2) else 0) == 10"]
HONEST = "def f(x):\n    return x * 4 + 2\n"


def run(code, tests):
    return run_in_sandbox(code, tests, limits=FAST)


@pytest.mark.parametrize("code", [LIAR, PATCHER], ids=["always-equal", "patched-builtins"])
def test_an_object_that_claims_everything_fails_every_statement_test(code):
    r = run("import math\n" + code, TESTS)
    assert r.status == "ok" and r.passed == [False] * len(TESTS), list(zip(TESTS, r.passed, r.details, strict=True))
    assert "NotBuiltinData: a value of type A" in r.details[0]


def test_the_same_tests_pass_an_honest_solution_and_fail_a_wrong_one():
    honest = run("import math\n" + HONEST, TESTS)
    # the tests were written for f(2) == 10 (f(3) == 14): all hold but the two that test `in` of an int
    expected = [t not in ("assert 3 in f(2)",) for t in TESTS]
    assert honest.passed == expected, list(zip(TESTS, honest.passed, honest.details, strict=True))
    wrong = run("import math\ndef f(x):\n    return x * 4 + 3\n", TESTS)
    # f(2) == 11, by hand: only the tests that do not pin the value hold
    assert [t for t, ok in zip(TESTS, wrong.passed, strict=True) if ok] == [
        "assert f(2)", "assert all([f(2)])", "assert any([f(2), f(3)])", "assert 0 < f(2) < 20"]


def test_the_review_s_cases_through_the_reward():
    """docs/review: the always-equal object earned 1.0 on two `assert f(x) == y` tests, and 0.5 with abs patched."""
    hack = "class A:\n    def __eq__(s,o): return True\ndef f(x): return A()"
    assert code_tests_reward(hack, json.dumps({"tests": ["assert f(2) == 10", "assert f(3) == 13"]})) == 0.0
    label = json.dumps({"tests": ["assert abs(f(2) - 0.5) < 1e-6", "assert f(3) == 7"]})
    patched = hack.replace("return True", "return True\n    def __sub__(s, o): return s") + \
        "\nimport builtins\nbuiltins.abs = lambda x: 0"
    assert code_tests_reward(patched, label) == 0.0
    assert code_tests_reward("def f(x):\n    return 0.5 if x == 2 else 7", label) == 1.0


def test_honest_solutions_pass_as_python_compares_them():
    code = """
import math
from collections import Counter, OrderedDict, defaultdict, deque, namedtuple
from enum import IntEnum
P = namedtuple("P", "x y")
class Color(IntEnum):
    RED = 1
def volume(l, b, h):
    return (l * b * h) / 2
def counts(s):
    return Counter(s)
def ordered(s):
    return OrderedDict((c, s.count(c)) for c in s)
def grouped(words):
    d = defaultdict(list)
    for w in words:
        d[len(w)].append(w)
    return d
def point():
    return P(1, 2)
def color():
    return Color.RED
def window(xs):
    return deque(xs, maxlen=2)
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        return self.items.pop()
"""
    tests = ["assert volume(10, 8, 6) == 240",  # MBPP 14: the reference returns 240.0
             "assert counts('aab') == {'a': 2, 'b': 1}", "assert ordered('ba') == {'a': 1, 'b': 1}",
             "assert grouped(['a', 'bc', 'd']) == {1: ['a', 'd'], 2: ['bc']}", "assert point() == (1, 2)",
             "assert point().x == 1", "assert color() == 1", "assert window([1, 2, 3]) == deque([2, 3])",
             "s = Stack()\ns.push(3)\nassert s.pop() == 3", "assert math.isclose(volume(1, 1, 1), 0.5)",
             "def check(candidate):\n    assert candidate(2, 1, 1) == 1\n    assert candidate(0, 1, 1) == 0\n"
             "check(volume)",
             "assert [v for v in (1, 2, 3) if volume(v, 2, 1) > 1] == [2, 3]",
             "x = volume(0, 1, 1) or [1]\nassert x == [1]",
             "assert point() is not None and not volume(0, 1, 1)", "assert sorted(counts('aab').values()) == [1, 2]",
             "assert all(volume(x, 2, 1) == x for x in range(4))", "assert color() is Color.RED",
             {"call": "volume(2, 1, 1)", "expected": 1.0}, "assert volume(2, 1, 1) == 2"]
    r = run(code, tests)
    assert r.passed == [True] * (len(tests) - 1) + [False], list(zip(tests, r.passed, r.details, strict=True))
    assert "AssertionError" in r.details[-1]


def test_a_test_that_does_not_compile_fails_alone():
    r = run(HONEST, ["assert f(", "assert f(2) == 10"])
    assert r.passed == [False, True] and "does not compile" in r.details[0] and "SyntaxError" in r.details[0]


def test_names_of_builtins_in_the_solution_do_not_reach_the_tests_but_its_functions_do():
    r = run("def len(x):\n    return 99\ndef f(x):\n    return len([x])\n", ["assert len([1, 2]) == 2",
                                                                         "assert f(1) == 99"])
    assert r.passed == [True, True]
