"""The live scheduler: requests and their events, the batcher that applies `scaletui.policy`'s
decisions, the request book, the page tables and the metrics; it drives an engine
(`serve.engine`)."""
