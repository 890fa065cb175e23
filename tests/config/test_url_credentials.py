"""No URL option holds a user or password (relax.config.validate._url_credentials): Relax records its URLs (MLflow
params and tags, config.resolved.yaml, the checkpoint's config.yaml and state.json,
.hydra/), so the config is refused before start with a message that names the environment variable to use and never
echoes the password; the same URLs without credentials are accepted (the controls)."""

from __future__ import annotations

import pytest

from relax.cli.config_check import problems
from relax.rewards.remote import RemoteReward, check_url

SECRET = "pwsecret"

CASES = [
    # (overrides with credentials, the same without, the option, what the message must name)
    (["data.reward=http://user:pwsecret@127.0.0.1:8131/ok"], ["data.reward=http://127.0.0.1:8131/ok"],
     "data.reward", "data.reward_service.api_key_env"),
    (["data.reward=https://pwsecret@127.0.0.1:8131/ok"], ["data.reward=https://127.0.0.1:8131/ok"],
     "data.reward", "data.reward_service.api_key_env"),  # a token as the user name
    (["reward_model=judge", "reward_model.engine=openai", "reward_model.url=https://me:pwsecret@api.example/v1"],
     ["reward_model=judge", "reward_model.engine=openai", "reward_model.url=https://api.example/v1"],
     "reward_model.url", "reward_model.api_key_env"),
    (["rollout=sglang", "rollout.sglang.urls=[http://h:1,http://me:pwsecret@h:2]", "rollout.num_replicas=2"],
     ["rollout=sglang", "rollout.sglang.urls=[http://h:1,http://h:2]", "rollout.num_replicas=2"],
     "rollout.sglang.urls", "RELAX_SGLANG_API_KEY"),
    (["tracking.uri=https://me:pwsecret@mlflow.example:5000"], ["tracking.uri=https://mlflow.example:5000"],
     "tracking.uri", "MLFLOW_TRACKING_PASSWORD"),
    (["tracking.uri=postgresql://me:pwsecret@db.example/mlflow"], ["tracking.uri=postgresql://me@db.example/mlflow"],
     "tracking.uri", "PGPASSWORD"),  # a database's user name is no secret: the control keeps it
]


@pytest.mark.parametrize(("bad", "good", "option", "instead"), CASES, ids=[f"{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_a_url_with_credentials_is_refused_naming_the_variable_to_use(bad, good, option, instead):
    message = problems(bad)
    assert message is not None and f"{option}=" in message and "holds a" in message, message
    assert instead in message
    assert SECRET not in message  # the message does not echo the password
    assert problems(good) is None  # control: the same URL without credentials


def test_a_remote_reward_refuses_credentials_without_echoing_them():
    """The client's own check (a RemoteReward made outside a run, e.g. by get_reward_fn)."""
    with pytest.raises(ValueError, match="data.reward_service.api_key_env") as caught:
        RemoteReward("http://user:pwsecret@127.0.0.1:8131/ok")
    assert SECRET not in str(caught.value) and "***@127.0.0.1:8131" in str(caught.value)
    assert check_url("http://127.0.0.1:8131/ok") is None  # control


def test_the_sglang_key_variable_named_is_the_one_read():
    from relax.runner.rollout_driver.sglang_engines import API_KEY_ENV

    assert API_KEY_ENV in problems(["rollout=sglang", "rollout.sglang.urls=[http://a:b@h:1]"])
