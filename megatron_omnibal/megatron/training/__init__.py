"""Training through megatron.training.pretrain: the entry point, the patched Megatron-LM's
hand-over, and the training log's OmniBal figures (throughput, MFU)."""
