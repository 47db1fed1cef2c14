"""SGLang's native API: POST /generate and its companions (routes.py), the request
it takes (request.py) and the answer it gives (output.py)."""
