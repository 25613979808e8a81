"""Native CPU decode steps: decoder layers wrapped to run a decode step as one C++ call (:mod:`.layers`), their
load-time checks (:mod:`.checks`), LoRA rows inside the call (:mod:`.lora`), and a model's whole layer list as one
call per decode step (:mod:`.stack`)."""
