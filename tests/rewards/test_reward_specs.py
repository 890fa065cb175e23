"""data.reward specs a user from other tools writes: a function named by its file (verl's custom_reward_function.path)
works, in the reward worker processes too; a batched function (TRL's and verl's plural parameters) and a URL of
another scheme are refused at start, each with a message that says what to do."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import textwrap

import pytest

from relax.data.datasets import load_prompt_file
from relax.data.tokenizer import build_tiny_tokenizer
from relax.rewards import RewardSpecError, get_reward_fn, score_responses
from relax.rewards.registry import check_record_fields
from relax.runner.rollout_driver.scoring import reward_contexts


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path

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
    # batched reward functions as TRL's GRPOTrainer and verl's BatchRewardManager call them: one list per argument
    def trl_kwargs(completions, **kwargs):  # reads the label's column (data.label_key's default, label) from kwargs
        return [float(s in c) + 0.5 * (t == "easy") for c, s, t in zip(completions, kwargs["label"], kwargs["tag"])]

    def trl_solution(completions, solution, **kwargs):  # TRL's accuracy_reward form
        return [float(s in c) + len(s) / 100 + 0.25 * (t == "easy") for c, s, t in zip(completions, solution,
                                                                                        kwargs["tag"])]

    def trl_ids(prompts, completions, completion_ids, **kwargs):  # TRL's documented form (the ids unread here)
        return [float(s in c) + 0.5 * ("q?" in p) for p, c, s in zip(prompts, completions, kwargs["label"])]

    def trl_state(completions, trainer_state=None, **kwargs):
        return [float(s in c) + 0.5 * isinstance(trainer_state, list) for c, s in zip(completions, kwargs["label"])]

    def keyword_only(completions, *, solution, scale=1.0):
        return [scale * float(s in c) + len(s) / 100 for c, s in zip(completions, solution)]

    def verl_batch(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(g in s) + (d == "openai/gsm8k") + e["index"] / 100
                for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]

    async def trl_async(completions, solution, **kwargs):
        return [float(s in c) + 0.25 * (t == "easy") for c, s, t in zip(completions, solution, kwargs["tag"])]
""")

COLUMNS = {  # a data set's records (two prompts) and its data.label_key
    "label": ([{"prompt": "q?", "label": "42", "tag": t} for t in ("easy", "hard")], "label"),
    # MATH's problem/solution/answer: a `solution` column that is not the label
    "math": ([{"prompt": "q?", "solution": "x = 42 as 6 * 7 = 42", "answer": "42", "tag": t} for t in ("easy", "hard")],
             "answer"),
    "solution": ([{"prompt": "q?", "solution": "42", "tag": t} for t in ("easy", "hard")], "solution"),
    "verl": ([{"prompt": "q?", "data_source": s, "reward_model": {"ground_truth": "42"}, "extra_info": {"index": i}}
              for i, s in enumerate(("openai/gsm8k", "other"))], "reward_model.ground_truth"),
}


def batch_call(fn, record: dict, completion: str) -> float:
    """`fn`'s value for one response as TRL calls it (GRPOTrainer: prompts, completions, completion_ids, every other
    column as a keyword of its name, trainer_state; only the names `fn` takes when it has no **kwargs), or verl
    (BatchRewardManager: data_sources, solution_strs, ground_truths, extra_infos), with lists of one item."""
    params = inspect.signature(fn).parameters
    if "solution_strs" in params:
        kwargs = {"data_sources": [record["data_source"]], "solution_strs": [completion],
                  "ground_truths": [record["reward_model"]["ground_truth"]], "extra_infos": [record["extra_info"]]}
    else:
        kwargs = {"prompts": [record["prompt"]], "completions": [completion], "completion_ids": [[7, 8, 9]],
                  **{k: [v] for k, v in record.items() if k != "prompt"}, "trainer_state": object()}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
    value = fn(**kwargs)
    return (asyncio.run(value) if inspect.iscoroutine(value) else value)[0]


@pytest.fixture(scope="module")
def trl_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl") / "trl_rw_wrap_h4.py"  # one file: a second of its name would be refused
    path.write_text(TRL_REWARDS)
    return path


@pytest.mark.parametrize("name, columns", [
    ("trl_kwargs", "label"), ("trl_solution", "math"), ("trl_solution", "solution"), ("trl_ids", "label"),
    ("trl_state", "label"), ("keyword_only", "solution"), ("verl_batch", "verl"), ("trl_async", "solution")])
def test_the_printed_wrapper_of_a_batched_function_returns_its_value(trl_file, tmp_path, name, columns):
    """The wrapper the refusal prints, pasted as it is beside the batched function, is accepted as data.reward and,
    called as a run calls a reward (its items' contexts, `score_responses`), returns what TRL's (verl's) own call of
    the batched function returns for that response."""
    namespace: dict = {}
    exec(compile(TRL_REWARDS, str(trl_file), "exec"), namespace)
    with pytest.raises(RewardSpecError) as err:
        get_reward_fn(f"{trl_file}:{name}")
    text = str(err.value)
    wrapper = re.search(r"(?:async )?def reward\(.*?\)\[0\]", text).group(0)
    if name == "trl_ids":  # Relax has no token ids: said, and never the label in their place
        assert "completion_ids=None" in wrapper and "Relax has no completion_ids to give" in text
    pasted = tmp_path / f"wf_{name}_{columns}.py"  # a module name no other test's file has
    pasted.write_text(f"{TRL_REWARDS}\n{wrapper}\n")
    spec = f"{pasted}:reward"
    reward = get_reward_fn(spec)
    records, label_key = COLUMNS[columns]
    items = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", records), build_tiny_tokenizer(),
                             keys=("prompt", label_key))
    check_record_fields(spec, reward, items, "data")  # every field it asks for is there
    completions = ["the answer is 42", "no idea"]
    scores = score_responses(reward, completions * len(items), [i.label for i in items for _ in completions],
                             contexts=reward_contexts(items, len(completions)))
    assert not any(scores.failed), scores.first_error
    assert scores.rewards == [batch_call(namespace[name], r, c) for r in records for c in completions]


def test_the_label_keyword_note_names_data_label_key(trl_file):
    """A (completions, **kwargs) function reads the label's column by its name, which Relax passes as label=."""
    with pytest.raises(RewardSpecError) as err:
        get_reward_fn(f"{trl_file}:trl_state")
    assert "label=[label] is data.label_key's default column" in str(err.value)


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
