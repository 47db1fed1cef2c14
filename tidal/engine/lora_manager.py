"""The runner's adapters: which exist (name -> PEFT folder), which are loaded in memory (a
least-recently-used cache of `max_cpu_loras`), and which sit in the `max_loras` slots a
step computes with. The scheduler guarantees a step uses at most `max_loras` adapters, so
`prepare` always finds each a slot."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable

import torch

from tidal.engine.config import LoRAConfig
from tidal.model.lora import LoRAAdapter, LoRAError, load_adapter
from tidal.model.lora_slots import SlotPool
from tidal.model.tensor_parallel import Shard

log = logging.getLogger("tidal.engine")


class LoRAManager:
    """Adapters by name for one model runner."""

    def __init__(self, config: LoRAConfig, max_loras: int, arch, model, dtype, device,
                 kernel=None, decoder=None, shard: Shard | None = None) -> None:
        """`shard`: this runner is a tensor-parallel rank (`arch` its shapes): each adapter
        is checked against the whole model and cut as its base layers are."""
        self.arch, self.max_rank, self.shard = arch, config.max_lora_rank, shard
        modules = config.modules
        self.capacity = config.max_cpu_loras or max(max_loras, len(modules))
        if config.lora_dtype != "auto":
            dtype = getattr(torch, config.lora_dtype)
        self.pool = SlotPool(model, arch, max_loras, config.max_lora_rank, dtype, device,
                             kernel, decoder)
        self.paths: dict[str, str] = {}  # every adapter requests may name
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU, the newest last
        self.steps = 0  # prepare() calls: when each slot was last used (0: never)
        self.used = [0] * max_loras
        for name, path in modules.items():
            self.register(name, path)

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Load and check the adapter in `path` under `name` (LoRAError if it does not fit
        this model, or `name` is taken)."""
        if name in self.paths:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        adapter = self._read(name, path)
        self.paths[name] = adapter.path
        self._keep(adapter, ())
        log.info("LoRA adapter %r loaded from %s (rank %d, %.1f MiB)", name, adapter.path,
                 adapter.rank, adapter.nbytes / 2**20)
        return adapter

    def unregister(self, name: str) -> None:
        """Forget `name`: new requests may not use it (the server unloads no adapter that
        requests still use)."""
        if name not in self.paths:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        del self.paths[name]
        self.loaded.pop(name, None)
        for i, n in enumerate(self.pool.names):
            if n == name:  # rewritten when the name comes back, and taken first meanwhile
                self.pool.names[i], self.used[i] = None, 0

    def load(self, name: str) -> None:
        """Have `name` in memory (read from its folder if the cache let it go)."""
        self._adapter(name, ())

    def prepare(self, names: Iterable[str]) -> dict[str, int]:
        """Each adapter of a step -> its slot, writing those not resident into slots whose
        adapters the step does not use."""
        wanted = set(names)
        self.steps += 1
        slots = {n: i for i, n in enumerate(self.pool.names) if n in wanted}
        for i in slots.values():
            self.used[i] = self.steps
        # empty slots first, then those whose adapter was used longest ago
        free = sorted((i for i, n in enumerate(self.pool.names) if n not in wanted),
                      key=lambda i: self.used[i])
        for name in sorted(wanted - set(slots)):
            if not free:
                raise RuntimeError(f"more adapters in one step than the {self.pool.num_slots} "
                                   "LoRA slots (the scheduler's max_loras bounds them)")
            slots[name] = free.pop(0)
            self.pool.write(slots[name], self._adapter(name, wanted))
            self.used[slots[name]] = self.steps
        return slots

    def _adapter(self, name: str, in_use: Iterable[str]) -> LoRAAdapter:
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
            return adapter
        if name not in self.paths:
            raise LoRAError(f"LoRA adapter {name!r} was unloaded")
        adapter = self._read(name, self.paths[name])
        self._keep(adapter, in_use)
        return adapter

    def _read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter in `path`, checked against the model (and cut to this rank's share:
        its pipeline stage's layers, numbered as the stage numbers them)."""
        if self.shard is None:
            return load_adapter(name, path, self.arch, self.max_rank)
        adapter = load_adapter(name, path, self.shard.arch, self.max_rank)
        layers = self.shard.layers or range(self.shard.arch.num_layers)
        adapter.weights = {(layer - layers.start, proj):
                           [(part, *self.shard.take_lora(proj, part, a, b))
                            for part, a, b in pieces]
                           for (layer, proj), pieces in adapter.weights.items()
                           if layer in layers}
        return adapter

    def _keep(self, adapter: LoRAAdapter, in_use: Iterable[str]) -> None:
        """Cache `adapter`, dropping the least recently used others over capacity."""
        self.loaded[adapter.name] = adapter
        keep = set(in_use) | {adapter.name}
        for name in list(self.loaded):
            if len(self.loaded) <= self.capacity:
                break
            if name not in keep:
                del self.loaded[name]
