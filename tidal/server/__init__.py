"""The HTTP layer: the OpenAI-compatible server (api.py, whose request and response bodies,
chat templates, tools and reasoning live in openai/), the live dashboard, metrics, error
bodies and limits, and the P/D router (pd_router.py), which shares the server's request
models and error bodies. It reaches the engine cores through tidal.runtime's CoreClient."""
