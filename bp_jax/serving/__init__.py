"""An OpenAI-compatible HTTP server over the continuous-batching engine (serve.py)."""
