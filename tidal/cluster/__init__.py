"""Past one engine core: routing policies (shared by the simulator and the dispatcher)."""
