"""tidal: an LLM serving engine whose heart is its scheduler."""

from tidal.core import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
