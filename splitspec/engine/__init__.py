"""What the target and draft engines share, below both services: sampling, token trees, the
paged KV pool, ragged attention over it, the FIFO batch planner and the engine-loop thread.
Nothing here imports a service package."""
