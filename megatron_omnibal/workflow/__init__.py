"""`omnibal finetune`: the whole workflow from one YAML file (stats, plan, convert, preflight,
train, export, compare-hf), each step by the project's own command, skipped when up to date."""
