"""The engines behind the `Engine` protocol (engine_api.py): the JAX engine, its model, KV cache,
compiled step programs and native CPU kernels, the fake engine, and the memory plan and build."""
