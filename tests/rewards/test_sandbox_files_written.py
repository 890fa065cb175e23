"""data.sandbox.files_written: how many times a sandboxed program may open a file for writing or create a directory or
a link (with data.sandbox.file_size_mb, what it may put on disk in all). Before, the bound was a constant (64) that no
option reached, and docs/training.md said the total was not bounded. A solution that writes 70 files fails under the
default and passes under data.sandbox.files_written=100 (configured limits reach the reward's worker processes);
the option is validated like the other data.sandbox.* limits."""

from __future__ import annotations

import json

import pytest

from relax.config import ConfigError, load_config
from relax.rewards.combined import reward_of
from relax.rewards.registry import score_responses

WRITES_70 = ("```python\ndef f(x):\n    for i in range(70):\n        with open(f'f{i}.txt', 'w') as out:\n"
             "            out.write('x')\n    return 70 + x\n```")
LABEL = json.dumps({"tests": [{"call": "f(1)", "expected": 71}]})


def test_the_configured_number_of_files_reaches_the_code_tests_reward():
    default = reward_of("code_tests", load_config(["data=code_tests"]).data.sandbox)
    roomy = reward_of("code_tests", load_config(["data=code_tests", "data.sandbox.files_written=100"]).data.sandbox)
    assert score_responses(default, [WRITES_70], [LABEL], timeout_s=30, workers=1).rewards == [0.0]
    assert score_responses(roomy, [WRITES_70], [LABEL], timeout_s=30, workers=1).rewards == [1.0]


def test_files_written_is_validated_like_the_other_limits():
    with pytest.raises(ConfigError) as info:
        load_config(["data=code_tests", "data.sandbox.files_written=0"])
    assert "data.sandbox.files_written=0 must be > 0" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(["data.sandbox.files_written=100"])  # no code_tests reward, no python tool
    assert "data.sandbox.files_written=100 has no effect" in str(info.value)
