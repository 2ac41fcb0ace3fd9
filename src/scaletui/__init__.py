"""scaletui: an LLM serving lab bench - JAX server, load generator and roofline, side by side."""

__version__ = "0.1.0"
