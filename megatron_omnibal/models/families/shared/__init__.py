"""What several model families share: the LLM's config reading and weight rules, InternViT
(internvl, internvl_chat), the Qwen native-resolution tower (qwen2_5_vl and its successors),
the data-side files of a checkpoint directory, the tiled towers' transformers forward."""
