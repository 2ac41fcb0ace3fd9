"""The server's HTTP face: the OpenAI-compatible routes, request validation, streaming, the
tokenizer, the admin guard and the stats; it hands requests to `serve.scheduling`."""
