"""A module imported on first use, so that the registry (config classes, flags, checks) loads without torch.

`relax.config` reads every algorithm's registry entry to compose and validate a config; the launcher
(`relax-train` before Ray) needs nothing else from this package. The algorithm modules therefore bind torch and
their math modules (`functional`, `loss`) through `lazy_module`: each attribute access imports the module (once:
`sys.modules` keeps it) and reads the attribute from it, so the first call of an advantage or loss function loads
torch and nothing earlier does. Attributes are not cached on the proxy, so a test that patches the real module is
seen by every caller.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class LazyModule(types.ModuleType):
    """Stands for the module `__name__`, which it imports on the first attribute read."""

    def __getattr__(self, attr: str) -> Any:
        module = sys.modules.get(self.__name__) or importlib.import_module(self.__name__)
        return getattr(module, attr)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self.__name__))


def lazy_module(name: str) -> Any:
    """The module `name` itself when it is imported already, else a `LazyModule` that imports it when first read."""
    return sys.modules.get(name) or LazyModule(name)
