"""OpenAI's Responses API, in one place: the request and its translation into a chat request
(`request.py`), the answer's output items and events (`output.py`), the routes (`routes.py`)
and the in-memory store of responses (`store.py`). A response runs as the chat request it
translates into: no second engine path."""
