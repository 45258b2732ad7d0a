"""C sources of megaray's CPU kernels, compiled on first use (``megaray.adamw``)."""
