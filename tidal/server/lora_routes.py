"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names an adapter (or
the base model), `/v1/models` lists the adapters with their `parent`, and, with
--enable-lora-runtime-updates, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
(vLLM's bodies) change the set on every engine core. An adapter is checked here first
(it must fit the base model), so a bad folder is a 400 naming it, never a core's error."""

from __future__ import annotations

import asyncio
from collections import Counter

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from tidal.model.config import ModelArch
from tidal.server.openai.protocol import APIError, StrictModel

routes = APIRouter()


class Adapters:
    """The adapters this server serves (name -> folder) and how many requests of each are
    in flight (an adapter in use is not unloaded)."""

    def __init__(self, client, names: tuple[str, ...], runtime_updates: bool) -> None:
        """`names`: the served model's (the first is the adapters' parent)."""
        self.client, self.names, self.base = client, names, names[0] if names else "model"
        lora = client.config.lora
        self.enabled, self.max_rank = lora.enable_lora, lora.max_lora_rank
        self.paths: dict[str, str] = dict(lora.modules)
        self.runtime_updates = runtime_updates
        self.in_flight: Counter[str] = Counter()
        self._lock = asyncio.Lock()  # one load or unload at a time

    def resolve(self, name: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model); a 400 with code
        model_not_found for anything else (404, as OpenAI's and vLLM's)."""
        if name is None or name in self.names:
            return None
        if name in self.paths:
            return name
        served = [*self.names, *self.paths]
        raise APIError(f"the model {name!r} does not exist; this server serves "
                       f"{', '.join(map(repr, served))}", 404, param="model",
                       code="model_not_found")

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "tidal",
                 "root": path, "parent": self.base, "max_model_len": max_model_len}
                for name, path in self.paths.items()]

    async def load(self, name: str, path: str) -> None:
        from tidal.model.lora import LoRAError, load_adapter  # torch: only when one loads

        self._check_updates()
        async with self._lock:
            if name in self.names or name in self.paths:
                raise APIError(f"the LoRA adapter {name!r} has already been loaded",
                               param="lora_name")
            arch = ModelArch.from_folder(self.client.folder)
            try:  # the cores load it again: a file read, off the event loop
                adapter = await asyncio.to_thread(load_adapter, name, path, arch, self.max_rank)
            except LoRAError as e:
                raise APIError(str(e), param="lora_path") from None
            self.paths[name] = adapter.path
            self.client.set_adapters(dict(self.paths))

    async def unload(self, name: str) -> None:
        self._check_updates()
        async with self._lock:
            if name not in self.paths:
                raise APIError(f"the LoRA adapter {name!r} cannot be found", 404,
                               param="lora_name", code="model_not_found")
            if self.in_flight[name]:
                raise APIError(f"the LoRA adapter {name!r} serves {self.in_flight[name]} "
                               "requests in flight; unload it once they finish",
                               param="lora_name")
            del self.paths[name]
            self.client.set_adapters(dict(self.paths))

    def _check_updates(self) -> None:
        if not self.enabled:
            raise APIError("this server serves no LoRA adapters (start it with --enable-lora)",
                           code="lora_disabled")
        if not self.runtime_updates:
            raise APIError("loading and unloading adapters at run time is off (start the "
                           "server with --enable-lora-runtime-updates)", code="lora_disabled")


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's; tidal refuses a name already loaded either way


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what tidal goes by


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    await request.app.state.frontend.adapters.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    await request.app.state.frontend.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
