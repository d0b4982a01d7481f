"""The model: built on the meta device from a transformers config, initialised, parallelized (activation
checkpointing, compile, FSDP2), its fused loss and FLOPs, Hugging Face weights in and out."""
