"""The built-in LLaVA pipeline module (a CLIP vision tower + projector for a Llama text model)."""
