"""tidal: an LLM serving engine whose heart is its scheduler."""

from tidal.core import PromptLogprob, SamplingParams, TokenLogprob
from tidal.engine.beam_search import BeamSearchParams

__all__ = ["BeamSearchParams", "LLM", "LoRARequest", "PromptLogprob", "SamplingParams",
           "TokenLogprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline API pulls in torch: import it only when asked for.
    if name in ("LLM", "LoRARequest"):
        from tidal.engine import llm
        return getattr(llm, name)
    raise AttributeError(name)
