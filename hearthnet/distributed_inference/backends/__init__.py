"""distributed_inference/backends."""
