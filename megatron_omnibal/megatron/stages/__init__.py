"""One rank's pipeline stage of the VLM: the layout of stages, megatron-core configs and layer
specs, the stage module and its parts, the provider, fine-tuning's frozen parts, the forward
step and loss."""
