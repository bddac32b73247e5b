"""Building blocks of the model code: paged attention, rotary embeddings, activations."""
