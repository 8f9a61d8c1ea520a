"""distributed_inference."""
