"""data.reward specs a user from other tools writes: a function named by its file (verl's custom_reward_function.path)
works, in the reward worker processes too; a batched function (TRL's and verl's plural parameters) and a URL of
another scheme are refused at start, each with a message that says what to do."""

from __future__ import annotations

import re
import textwrap

import pytest

from relax.rewards import RewardSpecError, get_reward_fn, score_responses

REWARDS = textwrap.dedent("""
    def exact(response, label):
        return float(response.strip() == label)

    def batched(responses, labels):
        return [0.0] * len(responses)

    def trl_style(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    def trl_completions(completions, **kwargs):
        return [0.0] * len(completions)

    def verl_batched(data_sources, solution_strs, ground_truths, extra_infos=None):
        return [0.0] * len(solution_strs)

    async def async_single(response, label):
        return float(response == label)
""")


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    """One file for the module: a second file of the same name elsewhere is refused (its module name is taken)."""
    path = tmp_path_factory.mktemp("rewards") / "rw_by_path_e5.py"  # a name no other test's module has
    path.write_text(REWARDS)
    return path


def test_a_function_named_by_its_file_scores_here_and_in_worker_processes(reward_file):
    fn = get_reward_fn(f"{reward_file}:exact")
    here = score_responses(fn, ["7", "8"], ["7", "7"])
    assert here.rewards == [1.0, 0.0] and here.failed == [False, False]
    # the limited calls run in fresh worker processes, which import the function by reference
    workers = score_responses(fn, ["7", " 7 ", "x"], ["7", "7", "7"], timeout_s=60)
    assert workers.rewards == [1.0, 1.0, 0.0] and workers.failed == [False] * 3, workers.first_error
    assert get_reward_fn(f"{reward_file}:exact") is fn  # the same module the second time


def test_a_relative_file_path(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent.parent)
    fn = get_reward_fn(f"{reward_file.parent.name}/{reward_file.name}:exact")
    assert score_responses(fn, ["1"], ["1"]).rewards == [1.0]


def test_file_paths_that_cannot_work_say_why(tmp_path, reward_file):
    with pytest.raises(RewardSpecError, match="no such file"):
        get_reward_fn(f"{tmp_path}/missing.py:exact")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(RewardSpecError, match="needs a .py file"):
        get_reward_fn(f"{tmp_path}/notes.txt:exact")
    shadow = tmp_path / "json.py"  # json is already a module: importing the file by its name would be another's
    shadow.write_text(REWARDS)
    with pytest.raises(RewardSpecError, match=r"already taken by .*json.*: rename json.py"):
        get_reward_fn(f"{shadow}:exact")
    bad = tmp_path / "my-reward.py"
    bad.write_text(REWARDS)
    with pytest.raises(RewardSpecError, match="no Python module name"):
        get_reward_fn(f"{bad}:exact")
    with pytest.raises(RewardSpecError, match="has no attribute 'nope'"):
        get_reward_fn(f"{reward_file}:nope")
    twin = tmp_path / reward_file.name  # another file of the same name: its module name is taken
    twin.write_text(REWARDS)
    with pytest.raises(RewardSpecError, match=f"already taken by {reward_file}: rename {reward_file.name}"):
        get_reward_fn(f"{twin}:exact")


@pytest.mark.parametrize("name, param", [("batched", "responses"), ("trl_style", "prompts"),
                                         ("trl_completions", "completions"), ("verl_batched", "solution_strs")])
def test_a_batched_function_is_refused_at_start(reward_file, name, param):
    with pytest.raises(RewardSpecError) as err:
        get_reward_fn(f"{reward_file}:{name}")
    text = str(err.value)
    assert f"looks batched (its parameter {param!r}" in text and "once per response" in text
    # its wrapper, called as the run calls a reward, calls it with one-item lists (verl's: data_source, extra_info)
    from relax.rewards.calls import RewardContext, call_once, reward_inputs

    namespace: dict = {}
    exec(REWARDS, namespace)
    exec(re.search(r"def reward\(.*?\)\[0\]", text).group(0), namespace)
    fields = {"data_source": "openai/gsm8k", "extra_info": {"index": 3}}
    args, kwargs = reward_inputs(namespace["reward"]).arguments("4", "4", RewardContext(prompt="2+2?", fields=fields))
    assert call_once(namespace["reward"], args, kwargs) == (0.0, None)


TRL_REWARDS = textwrap.dedent("""
    # TRL's two canonical batched forms: each data set column (the label's too) comes as a keyword list
    def trl_kwargs(completions, **kwargs):
        return [float(s in c) + 0.5 * (t == "easy") for c, s, t in zip(completions, kwargs["solution"], kwargs["tag"])]

    def trl_solution(completions, solution, **kwargs):
        return [float(s in c) + 0.25 * len(kwargs["tag"][0]) for c, s in zip(completions, solution)]
""")


@pytest.fixture(scope="module")
def trl_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl") / "trl_rw_wrap_h4.py"  # one file: a second of its name would be refused
    path.write_text(TRL_REWARDS)
    return path


@pytest.mark.parametrize("name", ["trl_kwargs", "trl_solution"])
def test_the_printed_wrapper_of_a_trl_batched_function_returns_its_value(trl_file, name):
    """The wrapper the refusal prints, written as given (label= as it says, with the label column's name) and called
    as the run calls a reward (by its parameters' names: `reward_inputs`), returns what TRL's own call of the batched
    function (every column as a keyword list) returns for that response."""
    from relax.rewards.calls import RewardContext, call_once, reward_inputs

    namespace: dict = {}
    exec(compile(TRL_REWARDS, str(trl_file), "exec"), namespace)
    with pytest.raises(RewardSpecError) as err:
        get_reward_fn(f"{trl_file}:{name}")
    text = str(err.value)
    wrapper = re.search(r"(?:async )?def reward\(.*?\)\[0\]", text).group(0)
    if "label=[label]" in wrapper:  # the label column's name, as the message says to write (data.label_key=solution)
        assert "for label= write data.label_key's name" in text
        wrapper = wrapper.replace("label=[label]", "solution=[label]")
    exec(wrapper, namespace)
    reward = namespace["reward"]
    fields = {"tag": "easy", "id": 7}
    for completion, label in [("the answer is 42", "42"), ("no idea", "42")]:
        want = namespace[name]([completion], solution=[label], prompt=["q?"], **{k: [v] for k, v in fields.items()})[0]
        args, kwargs = reward_inputs(reward).arguments(completion, label, RewardContext(prompt="q?", fields=fields))
        value, error = call_once(reward, args, kwargs)
        assert error is None, error
        assert value == want


@pytest.mark.parametrize("spec", ["/srv/rewards/verl_reward.py", "rewards/mine.py", "verl_reward.py"])
def test_a_file_without_its_function_names_the_file_form(spec):
    """verl's custom_reward_function.path is the file alone (its function name defaults to compute_score)."""
    with pytest.raises(RewardSpecError) as err:
        get_reward_fn(spec)
    text = str(err.value)
    assert "needs the function's name too: data.reward=<path>:function" in text
    assert f"data.reward={spec}:compute_score" in text and "unknown reward" not in text


def test_an_async_single_response_function_is_not_refused(reward_file):
    assert get_reward_fn(f"{reward_file}:async_single").__name__ == "async_single"


@pytest.mark.parametrize("url", ["ftp://x/y", "s3://bucket/reward", "grpc://host:1"])
def test_a_url_of_another_scheme_says_only_http_urls_are_services(url):
    with pytest.raises(RewardSpecError, match=r"only http:// and https:// URLs are reward services") as err:
        get_reward_fn(url)
    assert "cannot import" not in str(err.value)
