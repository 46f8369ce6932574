"""The OpenAI-compatible server: HTTP on rank 0, an engine loop with continuous batching on every rank."""
