"""The `--omnibal*` command line: its flags and their validation against Megatron's arguments,
and Megatron's command line completed from the plan."""
