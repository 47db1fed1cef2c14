"""The OpenAI-compatible server: an HTTP frontend process and an engine-core process."""
