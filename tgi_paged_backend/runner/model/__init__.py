"""Loading a checkpoint: the transformers model with our attention, its sizes (ModelSpec), which
families are served, RoPE scaling, Medusa heads."""
