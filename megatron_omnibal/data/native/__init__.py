"""Native-resolution vision (Qwen2.5-VL): its video rule, images and videos as patches."""
