"""OpenAI's API, as tidal speaks it: request bodies and their checks (protocol.py, chat.py),
response bodies (responses.py, schemas.py), structured outputs, tool calling and reasoning."""
