"""User-facing entry points: the command line (and, later, the HTTP server)."""
