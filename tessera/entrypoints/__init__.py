"""User-facing entry points: the offline `LLM` API, the `tessera` command line and the OpenAI-compatible server."""
