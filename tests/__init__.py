"""Tests, in folders that mirror the package's. tests/ is a package so that test files with
equal names in different folders collect, and so the shared helpers in tests/helpers/ import as
`tests.helpers.<name>`. Never put tests/ itself on sys.path: tests/megatron/ would shadow
megatron-core."""
