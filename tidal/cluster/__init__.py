"""Past one engine core: routing policies (shared by the simulator and the dispatcher), the
data-parallel dispatcher, where cores run (launch.py) and the P/D KV transfer. Below the
runtime that runs cores as processes: nothing here imports tidal.runtime, tidal.server or
tidal.cli."""
