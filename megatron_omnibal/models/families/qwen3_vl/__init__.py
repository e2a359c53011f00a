"""transformers' Qwen3-VL (`model_type` qwen3_vl): the native-resolution tower with a learned,
interpolated position table, DeepStack and a Qwen3 LLM with interleaved M-RoPE.

Its weight rules are here (weights.py); its FAMILY (config reading, data side, oracle) and its
line in the registry come with them, so until then no checkpoint or spec is read as Qwen3-VL.
"""
