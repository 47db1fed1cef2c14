"""The OpenAI-compatible server: an HTTP frontend process (api.py over client.py), the
engine-core process it starts (core_process.py), and the P/D router (pd_router.py), which
shares the server's request models and error bodies. Imports cluster/, never the reverse."""
