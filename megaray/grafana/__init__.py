"""The Grafana dashboard of megaray's Prometheus series (``megaray_dashboard.json``)."""
