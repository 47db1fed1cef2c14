"""OpenAI's Batch API: its input lines answered through the server's own app (`lines.py`),
offline (`offline.py`, `tidal run-batch`) or online, as `/v1/files` and `/v1/batches`
(`routes.py`) over a SQLite store (`store.py`) that a runner works through at low priority
(`runner.py`)."""
