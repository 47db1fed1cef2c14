"""The in-process engine: the engine core, the tokenizer and the output processor. `step()`
schedules, executes, updates and turns the token outputs into text."""

from __future__ import annotations

from tidal.core import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.core import EngineCore
from tidal.engine.output_processor import OutputProcessor
from tidal.engine.outputs import StepUpdate
from tidal.model.chat_template import template_source
from tidal.model.generation_config import sampling_defaults
from tidal.model.registry import resolve_model
from tidal.model.tokenizer import Tokenizer, tokenizer_folder


class Engine:
    """Runs requests to completion, one `step()` at a time, in this process: the engine core
    plus the tokenizer and the output processor."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        folder, self.model_name = resolve_model(config.model.model)
        self.runner_folder = folder
        self.tokenizer = Tokenizer(tokenizer_folder(config.model.tokenizer, folder))
        model = config.model  # checked before the model loads
        self.sampling_defaults = sampling_defaults(folder, model.generation_config,
                                                   model.override_generation_config)
        self.core = EngineCore(config, folder, self.tokenizer.eos_token_id)
        self.scheduler, self.executor = self.core.scheduler, self.core.executor
        self.outputs = OutputProcessor(self.tokenizer)
        self._counter = 0

    def close(self) -> None:
        """Stop what runs beside this process (a tensor-parallel group's other ranks)."""
        self.core.close()

    @property
    def runner(self):
        """The in-process worker's model runner (what tests and benchmarks look inside)."""
        return self.executor.worker.runner

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None,
                            content_format: str = "auto") -> list[int]:
        """A conversation's prompt ids, through the model's template or `chat_template`
        (a file's path or the template itself); `content_format` as ChatTemplate.render's."""
        if chat_template is not None:
            chat_template = template_source(chat_template)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  chat_template=chat_template,
                                                  content_format=content_format)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Queue a request; raises ValueError for one that can never run."""
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = self.tokenizer.bad_word_ids(params.bad_words)
        self.core.add(request_id, prompt_token_ids, params)
        self.outputs.track(request_id, params)
        return request_id

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.outputs.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_work()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepUpdate]:
        updates, stopped = self.outputs.process(self.core.step())
        for seq_id in stopped:
            self.core.finish(seq_id)
        return updates
