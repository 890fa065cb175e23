"""Composing a config: seconds per `relax.config.compose` and per `load_config` (compose + freeze + validate), over a
fixed mix of command lines (group choices, values, an experiment, an unknown key and a bad choice, which compose
twice). Both ways Hydra can copy its ConfigStore on a compose, in one process, alternating: `relax` (the copy
relax.config.store gives it, stored nodes shared) and `hydra` (Hydra's stock deep copy of every stored node, what
composing did before).

    python -m bench.compose --reps 5 --calls 24

Not a `python -m bench` section (a CPU-only micro-benchmark of the config layer); its numbers are in bench/notes.md.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import alternate, load_average

COMMAND_LINES = [
    [],
    ["algorithm=rloo"],
    ["algorithm=ppo", "model=tiny_moe"],
    ["train.lr=1e-5", "rollout.n_samples_per_prompt=8"],
    ["rollout=sglang"],
    ["data=gsm8k", "model=qwen3_0.6b"],
    ["+experiment=m2po"],
    ["cluster=1xgpu"],
    ["train.lrr=1"],  # an unknown key: composed again without it
    ["model=nonexistent"],  # a choice that names no option: the same
]


@contextmanager
def store_copy(way: str) -> Iterator[None]:
    """Within: Hydra copies its ConfigStore the `way` named (`relax`: as relax.config.store makes it; `hydra`: the
    stock deep copy, relax.config.store's __deepcopy__ taken off the class for the while)."""
    from hydra.core.config_store import ConfigStore

    import relax.config.store  # noqa: F401 - gives ConfigStore its __deepcopy__

    own = ConfigStore.__dict__["__deepcopy__"]
    if way == "hydra":
        del ConfigStore.__deepcopy__
    try:
        yield
    finally:
        ConfigStore.__deepcopy__ = own


def per_call(fn: Callable[[list[str]], object], lines: list[list[str]], way: str, calls: int) -> float:
    """Seconds per call of `fn`, over `calls` calls cycling through `lines`."""
    from relax.config import ConfigError

    with store_copy(way):
        start = time.perf_counter()
        for i in range(calls):
            try:
                fn(lines[i % len(lines)])
            except ConfigError:
                pass
        return (time.perf_counter() - start) / calls


def measure(reps: int, calls: int) -> dict:
    from relax.config import compose, load_config
    from relax.config.compose import compose_checked

    valid = COMMAND_LINES[:-2]  # plain compose raises Hydra's own error on the last two
    out: dict = {"load average before": load_average(), "calls per repetition": calls}
    for name, fn, lines in (("load_config", load_config, COMMAND_LINES),
                            ("compose_checked", compose_checked, COMMAND_LINES), ("compose", compose, valid)):
        series = alternate({way: (lambda _rep, w=way, f=fn, ls=lines: per_call(f, ls, w, calls))
                            for way in ("relax", "hydra")}, reps)
        out[name] = {way: {"median_s": round(s.median, 4), "spread_s": s.spread} for way, s in series.items()}
        out[name]["hydra / relax"] = round(series["hydra"].median / series["relax"].median, 3)
    out["load average after"] = load_average()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    print(json.dumps(measure(a.reps, a.calls), indent=2))


if __name__ == "__main__":
    main()
