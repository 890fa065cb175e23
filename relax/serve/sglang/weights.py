"""The weight and memory endpoints of the embedded server (`relax.serve.sglang.server`), as a mixin of
`EmbeddedServer`: loading weights into its model, the weight-update groups, the weight version, and releasing and
resuming the weights' memory.

Endpoints (SGLang's; every answer {"success", "message"}, 200, or 400 on failure): `/update_weights_from_tensor`
(load_format null or "flattened_bucket"), `/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`, `/update_weights_from_disk` (safetensors), `/update_weight_version`,
`/release_memory_occupation`, `/resume_memory_occupation`, and LoRA's `/load_lora_adapter`, `/unload_lora_adapter`.
Each waits for the running batch (`Scheduler.exclusive`).

LoRA (a server of a run with `model.lora_rank > 0` and `rollout.lora_sync=adapter`, SGLang's `--enable-lora`): the
model carries the run's adapters (`relax.models.lora.inject_adapters`), B zero until an adapter is loaded; one
adapter at a time (loading another replaces it; unloading the replaced one then succeeds), which every request is
served with: a `/generate` naming another (`lora_path`), or none while one
is loaded, is refused (HTTP 400) rather than served with weights it did not ask for.

Weights sent in several buckets are copied in as each bucket arrives (as SGLang does): a batch that runs between
two buckets sees some new and some old weights under the old version. Senders pause generation (or send nothing
to generate) while they update, and put `weight_version` on the last bucket.

`/release_memory_occupation` frees the weights (their storage, not the modules); `/resume_memory_occupation`
allocates them again with undefined contents: the caller must load weights before generating (as with SGLang
without CPU backup).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from relax.models.lora import read_adapter_dir
from relax.rollout.sglang import wire
from relax.serve.sglang import guards
from relax.serve.sglang.request import NotReady, RequestError
from relax.serve.sglang.scheduler import Scheduler
from relax.serve.sglang.server_args import memory_saver

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")


class WeightEndpoints:
    """The weight and memory routes of `EmbeddedServer`, which provides `engine`, `scheduler`, `weight_version`,
    `group_timeout_s` and `_require_ready`; `_init_weights` sets up this part's own state."""

    engine: Any
    scheduler: Scheduler
    weight_version: str
    group_timeout_s: float
    weight_dirs: guards.WeightDirs  # where /update_weights_from_disk and /load_lora_adapter may read
    _require_ready: Callable[[], None]

    def _init_weights(self) -> None:
        self._groups: dict[str, Any] = {}
        self._group_locks: dict[str, threading.Lock] = {}
        self._group_devices: dict[str, torch.device] = {}
        self._groups_lock = threading.Lock()  # guards the three dicts above
        self._shapes: dict[str, torch.Size] = {}  # of the released weights
        self.lora_name: str | None = None  # the loaded LoRA adapter
        self._replaced_adapters: set[str] = set()  # replaced by a newer one (unloading them is a no-op)

    # ----------------------------------------------------------------------------------------------- LoRA

    def _load_lora_adapter(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name, path = body.get("lora_name"), body.get("lora_path")
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise RequestError("load_lora_adapter: lora_name and lora_path (a PEFT adapter directory) are required")
            if not self.engine.adapter_keys:
                raise RequestError("this server has no LoRA adapters: a run with model.lora_rank > 0 and "
                                   "rollout.lora_sync=adapter starts it with them (SGLang: --enable-lora)")
            path = str(self.weight_dirs.check(path, "load_lora_adapter"))  # only the job's own directories
            try:
                named = read_adapter_dir(path)
            except (OSError, ValueError) as exc:
                raise RequestError(f"load_lora_adapter: cannot read {path!r}: {exc}") from None
            if set(named) != self.engine.adapter_keys:
                missing = sorted(self.engine.adapter_keys - set(named))[:3]
                extra = sorted(set(named) - self.engine.adapter_keys)[:3]
                raise RequestError(f"load_lora_adapter: {path!r} does not fit the server's adapters (missing "
                                   f"{missing}, unexpected {extra})")
            with self.scheduler.exclusive("load_lora_adapter"):
                self._apply(list(named.items()), None)
                replaced, self.lora_name = self.lora_name, name
            if replaced is not None and replaced != name:
                self._replaced_adapters.add(replaced)
                return f"Loaded LoRA adapter {name} in place of {replaced}."
            return f"Loaded LoRA adapter {name}."

        status, answer = self._weights_call(body, run)
        answer["loaded_adapters"] = {} if self.lora_name is None else {self.lora_name: body.get("lora_path")}
        return status, answer

    def _unload_lora_adapter(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name = body.get("lora_name")
            if name in self._replaced_adapters:  # one adapter at a time: a newer one took its place
                self._replaced_adapters.discard(name)
                return f"Unloaded LoRA adapter {name} (replaced by {self.lora_name})."
            if name is None or name != self.lora_name:
                raise RequestError(f"unload_lora_adapter: {name!r} is not loaded (loaded: {self.lora_name!r})")
            with self.scheduler.exclusive("unload_lora_adapter"):
                targets = self._targets()
                with torch.no_grad():
                    for key in self.engine.adapter_keys:
                        if ".lora_B." in key:
                            targets[key].zero_()  # B = 0: the base model again
                self.lora_name = None
            return f"Unloaded LoRA adapter {name}."

        return self._weights_call(body, run)

    def _lora_request(self, body: dict) -> dict:
        """`body` of a /generate without its `lora_path`, once it names the loaded adapter (or none is loaded)."""
        wanted = body.get("lora_path")
        names = set(wanted) if isinstance(wanted, list) else {wanted}
        if names != {self.lora_name}:
            have = "no adapter" if self.lora_name is None else f"adapter {self.lora_name!r}"
            raise RequestError(f"lora_path={wanted!r}: this server serves one adapter at a time and holds {have}; "
                               "name it in every request (lora_path), or none when none is loaded")
        return {k: v for k, v in body.items() if k != "lora_path"}

    def _targets(self) -> dict[str, torch.Tensor]:
        """Every loadable tensor by name (both names of a tied weight)."""
        model = self.engine.model
        targets = dict(model.state_dict(keep_vars=True))
        targets.update(dict(model.named_parameters(remove_duplicate=False)))
        return targets

    def _check_names(self, shapes: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Problems of loading tensors of these names and shapes (empty when fine)."""
        targets = self._targets()
        problems = []
        for name, shape in shapes:
            if "rotary_emb.inv_freq" in name:
                continue  # computed, not loaded (SGLang skips it too)
            target = targets.get(name)
            expected = self._shapes.get(name, None if target is None else tuple(target.shape))
            if target is None:
                problems.append(f"{name}: no such parameter")
            elif tuple(shape) != tuple(expected):
                problems.append(f"{name}: shape {list(shape)}, expected {list(expected)}")
        return problems

    def _apply(self, named: list[tuple[str, torch.Tensor]], version: Any) -> str:
        """Copy `named` into the model (all or nothing), then set the weight version; caller holds `exclusive`."""
        if "weights" in self.scheduler.released:
            raise RequestError("memory released (weights); call /resume_memory_occupation first")
        problems = self._check_names([(name, tuple(t.shape)) for name, t in named])
        if problems:
            raise RequestError("cannot load " + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
        targets = self._targets()
        with torch.no_grad():
            for name, tensor in named:
                if "rotary_emb.inv_freq" not in name:
                    targets[name].copy_(tensor)
        if version is not None:
            self.weight_version = str(version)
        return f"Updated {len(named)} tensors." + (f" Weight version updated to {version}." if version is not None
                                                   else "")

    def _weights_call(self, body: dict, run: Callable[[], str]) -> tuple[int, Any]:
        """A weight operation's answer: {"success", "message"}, 200 or 400."""
        self._require_ready()
        try:
            if body.get("abort_all_requests"):
                self.scheduler.abort_where(lambda r: True, "aborted for a weight update")
            message = run()
        except NotReady:
            raise
        except Exception as exc:  # SGLang answers a failed weight operation with success=false, HTTP 400
            if not isinstance(exc, RequestError):
                logger.warning("weight operation failed", exc_info=True)
            return 400, {"success": False, "message": f"{type(exc).__name__}: {exc}" if not isinstance(
                exc, RequestError) else str(exc)}
        return 200, {"success": True, "message": message}

    def _weights_from_tensor(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            payloads = body.get("serialized_named_tensors")
            if not isinstance(payloads, list) or not payloads:
                raise RequestError("serialized_named_tensors must be a list with one payload per TP rank")
            fmt = body.get("load_format")
            if fmt not in (None, "direct", "flattened_bucket"):
                raise RequestError(f"load_format={fmt!r} is not supported: null or flattened_bucket")
            # TP 1: rank 0's payload; it may map only the sender's shared-memory segments
            obj = wire.deserialize(payloads[0], segment_owner=guards.segment_owner())
            named = wire.unflatten_bucket(obj) if fmt == "flattened_bucket" else obj
            if not isinstance(named, (list, tuple)) or not all(
                    isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                    and isinstance(p[1], torch.Tensor) for p in named):
                raise RequestError("serialized_named_tensors must hold a list of (name, tensor) pairs")
            with self.scheduler.exclusive("update_weights_from_tensor"):
                return self._apply(list(named), body.get("weight_version"))

        return self._weights_call(body, run)

    def _weights_from_disk(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise RequestError("update_weights_from_disk: model_path is required")
            fmt = body.get("load_format")
            if fmt not in (None, "auto", "safetensors"):
                raise RequestError(f"load_format={fmt!r} is not supported: safetensors files only")
            directory = self.weight_dirs.check(path, "update_weights_from_disk")  # only the job's own directories
            files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
            if not files:
                raise RequestError(f"model_path={path!r}: no *.safetensors files in that directory")
            from safetensors.torch import load_file

            named = [item for f in files for item in load_file(str(f), device="cpu").items()]
            with self.scheduler.exclusive("update_weights_from_disk"):
                message = self._apply(named, body.get("weight_version"))
            return message

        status, answer = self._weights_call(body, run)
        answer["num_paused_requests"] = 0
        return status, answer

    # ----------------------------------------------------------------------------------- weight-update groups

    def _init_group(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name = body.get("group_name") or "weight_update_group"
            try:
                address, port = str(body["master_address"]), int(body["master_port"])
                rank, world = int(body.get("rank_offset") or 0), int(body["world_size"])
            except (KeyError, TypeError, ValueError) as exc:
                raise RequestError(f"init_weights_update_group: bad or missing field ({exc})") from None
            backend = body.get("backend") or "nccl"
            with self._groups_lock:
                if name in self._groups or name in self._group_locks:
                    raise RequestError(f"weight update group {name!r} exists; destroy it first")
                self._group_locks[name] = threading.Lock()
            try:
                group = wire.init_update_group(address, port, rank, world, name, backend, self.group_timeout_s)
            except Exception as exc:
                with self._groups_lock:
                    self._group_locks.pop(name, None)
                raise RequestError(f"joining weight update group {name!r} failed: {type(exc).__name__}: {exc}") \
                    from None
            with self._groups_lock:
                self._groups[name] = group
                self._group_devices[name] = self.engine.device if backend == "nccl" else torch.device("cpu")
            return f"Joined weight update group {name!r} as rank {rank} of {world} ({backend})."

        return self._weights_call(body, run)

    def _destroy_group(self, name: str) -> None:
        with self._groups_lock:
            group = self._groups.pop(name, None)
            self._group_locks.pop(name, None)
            self._group_devices.pop(name, None)
        if group is not None:
            wire.destroy_update_group(group)

    def _destroy_groups(self) -> None:
        """Leave every weight-update group (at shutdown)."""
        for name in list(self._groups):
            self._destroy_group(name)

    def _destroy_group_request(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name = body.get("group_name") or "weight_update_group"
            if name not in self._groups:
                raise RequestError(f"no weight update group {name!r}")
            self._destroy_group(name)
            return f"Destroyed weight update group {name!r}."

        return self._weights_call(body, run)

    def _weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            name = body.get("group_name") or "weight_update_group"
            group, lock = self._groups.get(name), self._group_locks.get(name)
            if group is None or lock is None:
                raise RequestError(f"no weight update group {name!r}; call /init_weights_update_group first")
            if body.get("load_format") not in (None, "direct"):
                raise RequestError(f"load_format={body.get('load_format')!r} is not supported here: null")
            names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
            if not (len(names) == len(dtypes) == len(shapes)):
                raise RequestError("names, dtypes and shapes must have the same length")
            specs = []
            for tensor_name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
                dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
                if not isinstance(dtype, torch.dtype):
                    raise RequestError(f"{tensor_name}: unknown dtype {dtype_name!r}")
                specs.append((str(tensor_name), dtype, tuple(int(s) for s in shape)))
            problems = self._check_names([(n, s) for n, _, s in specs])
            device = self._group_devices.get(name, torch.device("cpu"))  # gloo: CPU tensors, nccl: CUDA tensors
            received = []
            with lock:  # receive even after a problem, so that the sender's broadcasts complete
                for tensor_name, dtype, shape in specs:
                    tensor = torch.empty(shape, dtype=dtype, device=device)
                    torch.distributed.broadcast(tensor, src=0, group=group)
                    received.append((tensor_name, tensor))
            if problems:
                raise RequestError("cannot load " + "; ".join(problems[:8]))
            with self.scheduler.exclusive("update_weights_from_distributed"):
                return self._apply(received, body.get("weight_version"))

        return self._weights_call(body, run)

    def _update_weight_version(self, body: dict) -> tuple[int, Any]:
        self._require_ready()
        version = body.get("new_version")
        if version is None:
            raise RequestError("update_weight_version: new_version is required")
        if body.get("abort_all_requests"):
            self.scheduler.abort_where(lambda r: True, "aborted for a weight version update")
        self.weight_version = str(version)
        return 200, {"success": True, "message": f"Weight version updated to {version}", "new_version": str(version)}

    # ------------------------------------------------------------------------------------------------- memory

    def _tags(self, body: dict) -> set[str]:
        tags = body.get("tags")
        if tags is None:
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not set(tags) <= set(MEMORY_TAGS):
            raise RequestError(f"tags={tags!r}: expected null or a list of {', '.join(MEMORY_TAGS)}")
        return set(tags)

    def _release(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            if not memory_saver(self.cfg):  # as SGLang's memory-saver adapter refuses it
                raise RequestError("release_memory_occupation needs the memory saver (SGLang's --enable-memory-saver): "
                                   "this server's run is not colocated (cluster.colocate=false)")
            tags = self._tags(body)
            with self.scheduler.exclusive("release_memory_occupation"):
                # a health check queued meanwhile fails (as SGLang's gets no output once memory is released)
                self.scheduler.abort_where(lambda r: r.request.probe, "memory released before the health check ran")
                if self.scheduler.waiting():
                    raise RequestError("requests are waiting; pause generation or abort them first")
                if "weights" in tags and "weights" not in self.scheduler.released:
                    model = self.engine.model
                    self._shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
                    for param in model.parameters():
                        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                    if self.engine.device.type == "cuda":
                        torch.cuda.empty_cache()
                self.scheduler.set_released(tags, True)
            return f"Released {', '.join(sorted(tags))}."

        return self._weights_call(body, run)

    def _resume(self, body: dict) -> tuple[int, Any]:
        def run() -> str:
            tags = self._tags(body)
            with self.scheduler.exclusive("resume_memory_occupation"):
                if "weights" in tags and "weights" in self.scheduler.released:
                    for name, param in self.engine.model.named_parameters():
                        param.data = torch.empty(self._shapes[name], dtype=param.dtype, device=param.device)
                    self._shapes.clear()
                self.scheduler.set_released(tags, False)
            return f"Resumed {', '.join(sorted(tags))} (weights have undefined contents until loaded)."

        return self._weights_call(body, run)
