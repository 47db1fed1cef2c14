"""Generation requests in flight by the names their callers know them by, so that one (or
every one) can be ended early and still answered with what it generated: SGLang's
/abort_request, which RL frameworks send to cut rollouts short."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.runtime.client import CoreClient

if TYPE_CHECKING:
    from tidal.server.frontend import Submission


class InFlight:
    """The submissions being answered, each with its names: the answer's id, vLLM's
    `request_id` and SGLang's `rid` of each prompt, each naming some of its engine ids."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client
        self.names: dict[Submission, dict[str, list[str]]] = {}

    def add(self, sub: Submission, answer_ids: list[str], prompt_names: list[str]) -> None:
        """Name a submission until it ends: each of `answer_ids` names all its prompts, the
        i-th of `prompt_names` its i-th prompt (its n engine requests on a decode instance)."""
        names = {name: sub.rids for name in answer_ids}
        each = len(sub.rids) // max(1, len(prompt_names))  # a prompt's engine requests
        names.update({name: sub.rids[i * each:(i + 1) * each]
                      for i, name in enumerate(prompt_names)})
        self.names[sub] = names
        sub.on_end.append(lambda: self.names.pop(sub, None))

    async def stop(self, name: str | None, message: str, held: bool = True) -> None:
        """End the requests `name` names (None: every one) with finish reason `abort` and
        the text they have; with `held` False, not those a hold keeps unsent."""
        for sub, names in list(self.names.items()):
            for rid in sub.rids if name is None else names.get(name, ()):
                if held or rid not in self.client.streams.held:
                    await self.client.stop(rid, message)
