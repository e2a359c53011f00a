"""Dataset formats: annotation files (JSON, JSONL, InternVL meta), a record's shape, where a
sample's images come from, generated datasets."""
