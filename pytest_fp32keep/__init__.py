"""pytest plugin that proves a model keeps FP32 where it says so under FSDP2."""
