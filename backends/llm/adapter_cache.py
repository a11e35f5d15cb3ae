"""Which adapters an engine holds: read from the adapter root on first use, kept on the host, placed in device slots.

Two caches with capacities. The host cache holds up to `host_capacity` checked adapters (read from disk on a
request's first use, LoRAX-style, or by an explicit load); when it is full, the least recently used adapter that no
sequence uses and no device slot holds is evicted, and if every one is in use the new adapter is refused at once
(UNAVAILABLE). The device slots (backends/llm/lora.py) hold the adapters of running sequences: a sequence takes its
adapters' slots when it is admitted and gives them back when it finishes or is preempted; an idle slot keeps its
adapter for the next request until another adapter needs the slot (least recently used first). A slot in use is
never taken, so a sequence waits for a slot rather than fail.

An unloaded adapter is refused (NOT_FOUND) until it is loaded again, even though its folder is still in the root;
the sequences already using it finish with it, and its slot is freed when the last one ends.

The lock makes the host side safe for Triton's request threads; slots change only on the engine loop.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from backends.core.errors import Unavailable
from backends.llm.adapters import (NAME, AdapterLimits, AdapterNotFound, LoraAdapter, Router, load_adapter,
                                   load_router)
from backends.llm.lora import LoraSlots
from backends.llm.model import ModelArgs

AUTO = "auto"  # lora_id that routes a request to the top two adapters of the root's router


@dataclass
class AdapterStats:
    loads: int = 0  # adapters read from the root
    load_seconds: float = 0.0
    evictions: int = 0  # host cache evictions
    slot_loads: int = 0  # adapters copied into a device slot
    slot_evictions: int = 0  # idle adapters whose device slot another adapter took


class AdapterCache:
    def __init__(self, root: Path, args: ModelArgs, slots: LoraSlots, host_capacity: int,
                 limits: AdapterLimits | None = None):
        if host_capacity < slots.num_slots:
            raise ValueError(f"the host adapter cache ({host_capacity}) must hold at least the {slots.num_slots} "
                             "device slots")
        self.root, self.args, self.slots, self.host_capacity = Path(root), args, slots, host_capacity
        self.limits = limits or AdapterLimits(max_rank=slots.max_rank)
        self.lock = threading.Lock()
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.unloaded: set[str] = set()
        self.slot_of: dict[bytes, int] = {}  # adapter key -> its device slot
        self.slot_adapter: list[LoraAdapter | None] = [None] * slots.num_slots
        self.slot_users = [0] * slots.num_slots
        self.idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(slots.num_slots))  # reusable, LRU first
        self.stats = AdapterStats()
        self._router: Router | None = None

    # --- host side: any thread ------------------------------------------------------------------------------
    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, read from the root if it is not cached (raises AdapterError with the reason)."""
        with self.lock:
            if name in self.unloaded:
                raise AdapterNotFound(f"adapter {name!r} was unloaded; load it again to use it")
            return self._cached(name)

    def load(self, name: str) -> LoraAdapter:
        """Explicit load: also lifts an earlier unload."""
        with self.lock:
            adapter = self._cached(name)
            self.unloaded.discard(name)
            return adapter

    def unload(self, name: str) -> LoraAdapter | None:
        """Refuse `name` from now on and drop it from the caches; the adapter that was loaded (its `users` finish with
        it), None if it was not."""
        with self.lock:
            adapter = self.host.pop(name, None)
            if adapter is None and name not in self.unloaded:
                raise AdapterNotFound(f"adapter {name!r} is not loaded")
            self.unloaded.add(name)
            if adapter is not None and (slot := self.slot_of.get(adapter.key)) is not None and \
                    self.slot_users[slot] == 0:
                self._free_slot(slot)
            return adapter

    def choose(self, lora_id: str, pooled_embedding=None) -> tuple[tuple[LoraAdapter, float], ...]:
        """(adapter, share) pairs for a request's lora_id: one adapter, or for "auto" the router's top two
        (`pooled_embedding`: the prompt's mean input embedding)."""
        if lora_id != AUTO:
            return ((self.get(lora_id), 1.0),)
        router = self.router()
        if router is None:
            raise AdapterNotFound("lora_id 'auto' needs a router (router.json + router.safetensors) in the adapter "
                                  "root; this model has none")
        return tuple((self.get(name), share) for name, share in router.choose(pooled_embedding))

    def router(self) -> Router | None:
        with self.lock:
            if self._router is None:
                self._router = load_router(self.root, self.args)
            return self._router

    def hold(self, adapters) -> None:
        """A sequence starts using `adapters` (they count as in use until `drop`)."""
        with self.lock:
            for adapter in adapters:
                adapter.users += 1

    def drop(self, adapters) -> None:
        with self.lock:
            for adapter in adapters:
                adapter.users -= 1

    def listing(self) -> dict:
        """What `lora_action: list` answers."""
        with self.lock:
            loaded = [{"name": a.name, "rank": a.rank, "in_use": a.users, "on_device": a.key in self.slot_of}
                      for a in self.host.values()]
            folders = sorted(p.name for p in self.root.iterdir() if p.is_dir() and NAME.fullmatch(p.name)) \
                if self.root.is_dir() else []
            return {"loaded": loaded, "available": [n for n in folders if n not in self.host],
                    "unloaded": sorted(self.unloaded), "device_slots": self.slots.num_slots,
                    "host_capacity": self.host_capacity, "max_rank": self.slots.max_rank}

    def _cached(self, name: str) -> LoraAdapter:
        if (adapter := self.host.get(name)) is not None:
            self.host.move_to_end(name)
            return adapter
        if len(self.host) >= self.host_capacity:
            self._evict_host()
        started = time.perf_counter()
        adapter = load_adapter(self.root, name, self.args, self.limits, self.slots.dtype)
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - started
        self.host[name] = adapter
        return adapter

    def _evict_host(self) -> None:
        for name, adapter in self.host.items():
            slot = self.slot_of.get(adapter.key)
            if adapter.users == 0 and (slot is None or self.slot_users[slot] == 0):
                del self.host[name]
                if slot is not None:
                    self._free_slot(slot)
                self.stats.evictions += 1
                return
        raise Unavailable(f"all {self.host_capacity} adapters of the host cache are in use; try again later")

    # --- device slots: the engine loop ----------------------------------------------------------------------
    def acquire(self, adapters) -> list[int] | None:
        """Device slots for a sequence about to run, in the order of `adapters`; None (nothing taken) when a slot
        is needed and every slot is in use."""
        taken: list[int] = []
        with self.lock:
            for adapter in adapters:
                slot = self.slot_of.get(adapter.key)
                if slot is None:
                    if not self.idle:
                        self._release(taken)
                        return None
                    slot = next(iter(self.idle))
                    if self.slot_adapter[slot] is not None:
                        self.stats.slot_evictions += 1
                        self._free_slot(slot)
                    self.slots.write(slot, adapter)
                    self.slot_adapter[slot], self.slot_of[adapter.key] = adapter, slot
                    self.stats.slot_loads += 1
                self.slot_users[slot] += 1
                self.idle.pop(slot, None)
                taken.append(slot)
        return taken

    def release(self, slots: list[int]) -> None:
        with self.lock:
            self._release(slots)

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self.slot_users[slot] -= 1
            if self.slot_users[slot] == 0:
                adapter = self.slot_adapter[slot]
                if adapter is not None and self.host.get(adapter.name) is not adapter:
                    self._free_slot(slot)  # unloaded or evicted meanwhile: nobody will ask for it again
                else:
                    self.idle[slot] = None

    def _free_slot(self, slot: int) -> None:
        """The slot forgets its adapter (the weights stay until the next write) and is the first to be reused."""
        adapter = self.slot_adapter[slot]
        if adapter is not None:
            del self.slot_of[adapter.key]
        self.slot_adapter[slot] = None
        self.idle[slot] = None
        self.idle.move_to_end(slot, last=False)

    @property
    def on_device(self) -> int:
        return len(self.slot_of)
