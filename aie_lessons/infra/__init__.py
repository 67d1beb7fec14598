"""Hand-written infrastructure: where files live, what machine this is, how the model arrives."""
