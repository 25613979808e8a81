"""Multi-LoRA serving: ``LORA_ADAPTERS`` parsed as stock TGI (:mod:`.sources`), PEFT checkpoints read and
checked against the base model (:mod:`.checkpoint`), and the batched deltas in the forward
(:mod:`.layers`, kernels in :mod:`tgi_paged_kernels.lora`). The engine routes ``Request.adapter_id`` to an
adapter index (0: the base model) with :class:`.sources.AdapterNames`."""
