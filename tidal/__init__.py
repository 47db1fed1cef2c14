"""tidal: an LLM serving engine whose heart is its scheduler."""

from tidal.core import PromptLogprob, SamplingParams, TokenLogprob

__all__ = ["LLM", "PromptLogprob", "SamplingParams", "TokenLogprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline API pulls in torch: import it only when asked for.
    if name == "LLM":
        from tidal.engine.llm import LLM
        return LLM
    raise AttributeError(name)
