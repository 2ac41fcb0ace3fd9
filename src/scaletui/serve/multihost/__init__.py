"""One server over several JAX processes (`jax.distributed`): process 0 serves HTTP and sends
each scheduling pass's inputs to the others, which run the same passes (docs/serve.md,
"Multi-host")."""
