"""The inference server, in layers that import one way: http -> scheduling -> engine -> weights
(`scaletui.commands.serve` assembles them)."""
