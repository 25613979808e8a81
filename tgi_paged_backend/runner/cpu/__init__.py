"""CPU load-time rewrites of the model: fused q/k/v and gate/up blocks, the layer (and MoE) forms the native
decoder layers (:mod:`..native`) run, oneDNN-packed linears and fused norms."""
