"""Multi-LoRA serving: adapters in a slot pool on the engine's device, applied per token in mixed batches.

layers.py   LoRALinear (base projection + per-token delta) and LoRABatch (the step's token grouping)
weights.py  a PEFT adapter's tensors mapped onto our fused projections
manager.py  LoRAManager: registered adapters, slots with LRU eviction and pins, per-step preparation
"""
