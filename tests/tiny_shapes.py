"""The smallest Mamba-3 shape the tests train: one layer, d_model 16, one head of 8 (a second or two
per run on CPU). Tests add their own vocab_size / eos_id."""

TINY_MODEL_SHAPE = dict(d_model=16, n_layers=1, d_intermediate=32, d_state=8, headdim=8, chunk_size=8)
