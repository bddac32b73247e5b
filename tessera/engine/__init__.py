"""The engine: input preprocessing, scheduling over a paged KV cache, model execution and outputs.

The path of a request through these files: docs/architecture.md."""
