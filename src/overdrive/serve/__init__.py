"""`overdrive serve`: the Open Inference Protocol server with dynamic batching (batcher, protocol, model adapter, app, runner)."""
