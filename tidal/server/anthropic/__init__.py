"""Anthropic's Messages API, in one place: the request and its translation into a chat
request (`request.py`), the answer's content blocks and events (`output.py`), the error
shape its routes answer with (`protocol.py`) and the routes (`routes.py`). A message runs as
the chat request it translates into: no second engine path."""
