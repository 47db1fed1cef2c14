"""Past one engine core: routing policies (shared by the simulator and the dispatcher), the
data-parallel dispatcher, where cores run (launch.py) and the P/D KV transfer. Below the
server: nothing here imports tidal.server or tidal.cli."""
