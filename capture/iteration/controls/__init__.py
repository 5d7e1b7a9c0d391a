"""Per-request sampling controls applied inside the captured step: penalties, logit bias,
min_tokens, logprobs and grammar-constrained decoding (see `state.SamplingControls`)."""
