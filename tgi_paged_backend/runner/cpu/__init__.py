"""CPU load-time rewrites of the model: fused q/k/v and gate/up blocks, native C++ decoder layers,
oneDNN-packed linears and fused norms."""
