"""URL options that must not hold a user or password: Relax records them (MLflow params and tags, the job's
config.resolved.yaml and .hydra/, the checkpoint's config), so a secret belongs in an environment variable. The
config's rules (`relax.config.validate`, `relax.config.reward_list_rules`) and the reward service client
(`relax.rewards.remote`) ask the same question here.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit


def without_credentials(url: str) -> str:
    """`url` with the user and password of its netloc (`user:password@`) replaced by `***@`: a URL fit for a message."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]).geturl()


def without_secrets(url: str) -> str:
    """`url` as a message may name it: its user and password replaced by `***@` (`without_credentials`) and its query
    and fragment, which may carry a token, by `?***`."""
    parts = urlsplit(without_credentials(url))
    if not parts.query and not parts.fragment:
        return parts.geturl()
    return parts._replace(query="", fragment="").geturl() + "?***"


_USERINFO = re.compile(r"(://)[^/@\s]+@")  # a URL's user[:password]@
# a URL's query or fragment: up to a quote, a space, a bracket, or a comma that starts a list's next URL or quoted item
# (a sweep job's overrides hold Hydra's escapes: `http\://`)
_QUERY = re.compile(r"[?#].*?(?=,\s*(?:[a-z][a-z0-9+.-]*\\?://|['\"])|[\]'\"\s]|$)", re.IGNORECASE)
_URL = re.compile(r"://")


def masked_override(override: str) -> str:
    """An override as a message shows it (a sweep's job headers, a duplicate's refusal): where its value holds URLs,
    each one's user:password@ as `***@` and its query or fragment as `?***`, as `without_secrets` shows one URL (the
    rules refuse both in URL options, and their messages never echo them); any other override as written."""
    key, eq, value = override.partition("=")
    if not eq or not _URL.search(value):
        return override
    return key + "=" + _QUERY.sub("?***", _USERINFO.sub(r"\1***@", value))


def credentials_problem(option: str, url: object, instead: str, *, password_only: bool = False) -> str | None:
    """The message for a URL option (`option`) whose value holds a user or password (only a password with
    `password_only`: a database's user name is no secret), or None: the URL is recorded (MLflow params, the job's
    config.resolved.yaml and .hydra/, the checkpoint's config), so a secret belongs in an environment variable
    (`instead` says which). The message does not echo the credentials (relax.rewards.remote.check_url asks it
    too)."""
    if not isinstance(url, str):
        return None
    netloc = urlsplit(url.strip()).netloc
    if "@" not in netloc or (password_only and ":" not in netloc.rsplit("@", 1)[0]):
        return None
    what, them = ("a password", "it") if password_only else ("a user or password", "them")
    return (f"{option}={without_secrets(url.strip())!r} holds {what} (user:password@): the URL is recorded "
            f"(MLflow params, the job's output directory, the checkpoint's config); remove {them} and {instead}")


def query_problem(option: str, url: object, instead: str, *, base: str = "http(s)://host:port/v1") -> str | None:
    """The message for a URL option that names an API's base (`option`: reward_model.url, rollout.sglang.urls)
    whose value has a query or a fragment (`?api_key=...`, `#...`), or None. A key there would be recorded as
    `credentials_problem` says, and the client appends its paths to the base (`/chat/completions`), which would land
    in the query; `base` is the shape the option takes, `instead` where the key goes. The message shows the URL
    with its query and fragment masked (`without_secrets`)."""
    if not isinstance(url, str) or not any(c in url for c in "?#"):
        return None
    shown = without_credentials(url.strip()).split("#", 1)[0].split("?", 1)[0] + "?***"
    return (f"{option}={shown!r} has a query or fragment (?...#...): {option} is the API's base URL ({base}) "
            f"without one, and the URL is recorded (MLflow params, the job's output directory, the checkpoint's "
            f"config); remove it and {instead}")


REWARD_KEY_INSTEAD = ("put the key in an environment variable named by data.reward_service.api_key_env (sent as a "
                      "Bearer key)")
