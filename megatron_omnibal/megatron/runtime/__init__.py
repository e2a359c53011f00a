"""What megatron-core needs to run here: the CPU + gloo layer, Python-version shims, whole-line
stderr writes and once-per-run fallback notes. Imports no other room."""
