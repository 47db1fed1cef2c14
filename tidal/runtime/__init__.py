"""Engine cores as processes: the core process's main loop (core_process.py), and the
frontend's handle on its cores (client.py), built from the ZMQ sockets it talks over
(transport.py), the per-request streams it feeds (streams.py), the cores' merged stats
(core_stats.py) and their supervision across deaths and restarts (core_watch.py).

Above cluster/ (it runs the dispatcher and the P/D KV link), below server/: the HTTP layer
only calls CoreClient. The messages themselves are tidal/engine/messages.py."""
