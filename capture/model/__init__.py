"""The Llama-family model: config, weights, KV cache, checkpoint and text."""
