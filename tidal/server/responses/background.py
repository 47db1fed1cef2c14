"""Background responses (`background: true`, OpenAI's): the create call answers at once with
the response `queued`; its generation runs as a task of the server, and the store holds the
response as it stands (`in_progress`, then `completed`, `incomplete`, `failed` or
`cancelled`) for `GET /v1/responses/{id}` to poll. `POST /v1/responses/{id}/cancel` stops
one: its sequences end at once and their blocks return."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from tidal.server.frontend import Submission, finish
from tidal.server.openai.generation_bodies import Updates
from tidal.server.openai.protocol import APIError
from tidal.server.responses.output import ResponseBody
from tidal.server.responses.store import ResponseStore


class BackgroundResponses:
    """The background responses being answered, by id; the store keeps each one's state."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.tasks: dict[str, asyncio.Task] = {}

    def run(self, response: ResponseBody, updates: Updates, sub: Submission | None) -> dict:
        """Answer in the background; the response as created. Its `on_done` keeps it
        finished, with its conversation for successors."""
        self._keep(response.snapshot("in_progress"))
        self.tasks[response.id] = asyncio.create_task(self._answer(response, updates, sub))
        return response.snapshot("queued")

    async def cancel(self, response_id: str) -> None:
        """Stop a response still being answered (nothing if it is done)."""
        task = self.tasks.get(response_id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _answer(self, response: ResponseBody, updates: Updates,
                      sub: Submission | None) -> None:
        try:
            await response.body(updates)
        except asyncio.CancelledError:
            self._keep(response.snapshot("cancelled"))
            raise
        except APIError as exc:  # the engine failed it, or its core died
            failed = response.snapshot("failed")
            failed["error"] = {"code": "server_error", "message": exc.message}
            self._keep(failed)
        finally:
            self.tasks.pop(response.id, None)
            await finish(sub, updates)

    def _keep(self, body: dict) -> None:
        """A response not (or never) finished: pollable, not continued by a successor."""
        self.store.put(body["id"], msgspec.json.encode(body), None)
