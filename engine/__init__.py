"""Target-model runtime: model, KV cache, scheduler, sampling, engine loop."""
