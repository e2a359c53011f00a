"""Model families, one folder each: what a family of checkpoints has of its own (config reading,
HF <-> Megatron weight rules, data side, the planner's vision-attention terms, transformers'
forward as the oracle), registered in `registry.py`. What several families share lives in
`shared/`; the torch side of building a family's stages is megatron/stages/families.py."""
