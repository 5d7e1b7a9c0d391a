"""One iteration of the engine: inputs, step, sampling, speculation, graphs, and the Engine that owns them."""
