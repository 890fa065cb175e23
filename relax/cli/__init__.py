"""Entry points (relax-train, ...): argument handling only; the work happens in relax.runner.

Layer 9 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""

import atexit
import gc
import sys


def _set_aside_objects() -> None:
    """The last exit hook of a command (the first registered runs last): its objects are set aside (`gc.freeze`)
    instead of collected. A command ends in interpreter finalization, whose garbage collection frees every object
    that torch, transformers, MLflow and Ray created: CPU time after the command's last line that grows with what it
    imported (docs/performance.md, "Ending a command"). Nothing needs that collection at this point: runs,
    checkpoints and Ray are closed explicitly before, files and logging handlers by their own exit hooks, and the
    memory goes with the process. Where triton is loaded (megatron-core, torch.compile) objects are collected as
    usual: its extension reports each instance still alive at exit as a leak."""
    if "triton" not in sys.modules:
        gc.freeze()


atexit.register(_set_aside_objects)
