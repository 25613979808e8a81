"""The model rewrites applied once at load, in order (:data:`.pipeline.MODEL_REWRITES`): tensor-parallel
slicing, LoRA wrapping, CPU block fusion, native CPU decoder layers, packed linears. Each rewrite is a small
module with ``applies`` / ``apply``; :func:`.pipeline.run_rewrites` runs them and logs which ran, on how many
modules, and why the others did not."""
