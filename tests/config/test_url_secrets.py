"""An option that names an API's base (reward_model.url, rollout.sglang.urls) takes no query or fragment
(relax.config.credentials.query_problem, asked by relax.config.validate._url_credentials): a key there
(`?api_key=...`) would be recorded with the URL (MLflow params, config.resolved.yaml, the checkpoint's config), and
the client appends its paths to the base, which would land in the query. The config is refused before start with one
message per option that names it and where the key goes, without echoing the key; the same URL without the query is
accepted (the controls). The plan's judge line masks a query too (defence in depth)."""

from __future__ import annotations

import dataclasses

import pytest

from relax.cli.config_check import problems
from relax.config.compose import load_config
from relax.runner.plan import build_plan

SECRET = "sk-secret123"
JUDGE = ["reward_model=judge", "reward_model.engine=openai"]
SGLANG = ["rollout=sglang", "rollout.num_replicas=2"]

CASES = [
    # (overrides with a query or fragment, the same without, the option, where the key goes)
    ([*JUDGE, f"reward_model.url='http://127.0.0.1:8000/v1?api_key={SECRET}'"],
     [*JUDGE, "reward_model.url=http://127.0.0.1:8000/v1"], "reward_model.url", "reward_model.api_key_env"),
    ([*JUDGE, f"reward_model.url='https://api.example/v1#{SECRET}'"],
     [*JUDGE, "reward_model.url=https://api.example/v1"], "reward_model.url", "reward_model.api_key_env"),
    ([*JUDGE, f"reward_model.url='https://me:pw@api.example/v1?key={SECRET}'"],  # credentials and a query: masked both
     [*JUDGE, "reward_model.url=https://api.example/v1"], "reward_model.url", "reward_model.api_key_env"),
    ([*SGLANG, f"rollout.sglang.urls=['http://h:1?key={SECRET}','http://h:2?key={SECRET}']"],
     [*SGLANG, "rollout.sglang.urls=[http://h:1,http://h:2]"], "rollout.sglang.urls", "RELAX_SGLANG_API_KEY"),
]


@pytest.mark.parametrize(("bad", "good", "option", "instead"), CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_an_api_base_with_a_query_is_refused_naming_where_the_key_goes(bad, good, option, instead):
    message = problems(bad)
    assert message is not None and f"{option}=" in message, message
    assert instead in message, message
    assert SECRET not in message, message  # the message does not echo the key
    assert message.count(f"{option}=") == 1, message  # one message for the option (two sglang URLs with a key)
    assert problems(good) is None  # control: the same URL without its query


def test_the_plan_masks_a_query_of_the_judge_url():
    """The plan (`relax-train dry_run=true`) names the judge's URL without its query, even for a config that did not
    come through the rules (a config built in code)."""
    cfg = load_config([*JUDGE, "reward_model.url=http://127.0.0.1:8000/v1"])
    leaky = dataclasses.replace(cfg, reward_model=dataclasses.replace(
        cfg.reward_model, url=f"http://127.0.0.1:8000/v1?api_key={SECRET}"))
    text = build_plan(leaky).render()
    assert "judge at http://127.0.0.1:8000/v1?***," in text, text
    assert SECRET not in text
    assert "judge at http://127.0.0.1:8000/v1," in build_plan(cfg).render()  # control: a plain URL as it is


def test_a_sweep_jobs_header_masks_a_query_too():
    """A sweep's refusal heads each job with its overrides: a URL's query is masked there as in the rule's message
    (the header masked only user:password@)."""
    message = problems(["-m", *JUDGE, "seed=1,2", f"reward_model.url='http://127.0.0.1:8000/v1?api_key={SECRET}'"])
    assert message is not None and "job 0 (" in message and "v1?***" in message, message
    assert SECRET not in message, message
