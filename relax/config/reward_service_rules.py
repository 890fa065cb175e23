"""The rules of remote reward services (`data.reward=http(s)://...`, options in `data.reward_service`), reported with
the rest of the config's (`relax.config.validate`): the URL's shape, the options' ranges, options set without a
service (rejected, not ignored), the time limit that a service does not read, and the key's environment variable;
the time limit of the code_tests rewards, which must leave room for the sandbox's own; and the stop after steps of
failed rewards, which only dropping failed groups reaches."""

from __future__ import annotations

import dataclasses
import os
from urllib.parse import urlsplit

from relax.algorithms.base import Violation, range_of
from relax.config.schema import RelaxConfig, RewardServiceConfig
from relax.sandbox_limits import CODE_TESTS_MARGIN_S, code_tests_limits

# code_tests_limits (relax.sandbox_limits): the wall-clock limit of the code_tests rewards' sandbox runs under
# data.sandbox, which relax.rewards.code_tests reads too: a reward call limited to less would turn a program stopped by
# the sandbox (a counted time-out, reward 0) into a failed reward call (its group left out)

CODE_TESTS_REWARDS = ("code_tests", "code_tests_all")


def is_service(reward: str) -> bool:
    return reward.strip().lower().startswith(("http://", "https://"))


def reward_service_violations(cfg: RelaxConfig) -> list[Violation]:
    """Every broken rule of `data.reward`'s services and `data.reward_service`, for one reward or each entry of a list
    (`relax.config.reward_list_rules`): the code_tests rewards' time limit, a service URL's host, the options of
    `data.reward_service` (which every service of a list shares; refused when no entry is a service), and
    `data.reward_timeout_s`, refused when every entry is a service (none reads it)."""
    d, out = cfg.data, []
    svc = d.reward_service

    def require(ok: bool, fields: tuple[str, ...] | str, message: str) -> None:
        if not ok:
            out.append(Violation((fields,) if isinstance(fields, str) else tuple(fields), message))

    default = RewardServiceConfig()
    require(d.reward_error == "drop_group" or d.max_failed_reward_steps == type(d)().max_failed_reward_steps,
            ("data.max_failed_reward_steps", "data.reward_error"),
            f"data.max_failed_reward_steps={d.max_failed_reward_steps} has no effect with data.reward_error="
            f"{d.reward_error}: the first failed reward call stops the run")
    single = isinstance(d.reward, str)
    if single:
        specs = [d.reward]
    elif isinstance(d.reward, (list, tuple)) and d.reward and all(isinstance(s, str) for s in d.reward):
        specs = list(d.reward)
    else:  # a malformed list: relax.config.reward_list_rules names what is wrong with it
        return out

    def named(spec: str) -> str:  # how a message names one reward: the option itself, or an entry of the list
        return f"data.reward={spec}" if single else f"data.reward's {spec.strip()}"

    code = [s for s in specs if s.strip() in CODE_TESTS_REWARDS]
    wall = d.sandbox.wall_s
    if code and d.reward_timeout_s is not None and (wall is None or (isinstance(wall, (int, float)) and wall > 0)):
        limit = code_tests_limits(d.sandbox)["wall_s"]
        require(d.reward_timeout_s > limit + CODE_TESTS_MARGIN_S,
                ("data.reward_timeout_s", "data.reward") if wall is None else
                ("data.reward_timeout_s", "data.sandbox.wall_s", "data.reward"),
                f"data.reward_timeout_s={d.reward_timeout_s} must be more than {limit + CODE_TESTS_MARGIN_S:g} s, the "
                f"sandbox's wall-clock limit of {named(code[0])} ({limit:g} s"
                f"{', data.sandbox.wall_s' if wall is not None else ''}) plus a {CODE_TESTS_MARGIN_S:g} s margin: a "
                "program the sandbox stops fails its tests; a reward call stopped first would be a reward error "
                "instead")
    urls = [s for s in specs if is_service(s)]
    if not urls:
        which = f"data.reward={d.reward} is not" if single else f"no entry of data.reward={specs} is"
        for f in dataclasses.fields(svc):
            require(getattr(svc, f.name) == getattr(default, f.name), (f"data.reward_service.{f.name}", "data.reward"),
                    f"data.reward_service.{f.name}={getattr(svc, f.name)!r} has no effect: {which} a reward service "
                    "(an http:// or https:// URL)")
        return out
    for u in urls:
        parts = urlsplit(u.strip())
        try:
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        require(bool(parts.hostname) and port_ok, "data.reward",
                f"{'data.reward=' if single else 'data.reward entry '}{u!r}: a reward service URL needs a host (and a "
                "valid port if one is given)")
    for f in dataclasses.fields(svc):
        allowed = range_of(RewardServiceConfig, f.name)
        if allowed is not None:
            require(allowed.admits(getattr(svc, f.name)), f"data.reward_service.{f.name}",
                    allowed.message(f"data.reward_service.{f.name}", getattr(svc, f.name)))
    if len(urls) == len(specs):
        require(d.reward_timeout_s == type(d)().reward_timeout_s, ("data.reward_timeout_s", "data.reward"),
                f"data.reward_timeout_s={d.reward_timeout_s} has no effect on a reward service: its requests are "
                "limited by data.reward_service.timeout_s" if single else
                f"data.reward_timeout_s={d.reward_timeout_s} has no effect: every entry of data.reward is a reward "
                "service, whose requests are limited by data.reward_service.timeout_s")
    if svc.api_key_env:
        require(bool(os.environ.get(svc.api_key_env)), "data.reward_service.api_key_env",
                f"data.reward_service.api_key_env={svc.api_key_env}: the environment variable is not set (or empty)")
    return out
