"""Shipped YAML configs (data only); ``megaray.config.shipped_config`` finds them."""
