"""Job entrypoints (imported as ``megaray.pipelines``), e.g.
``ray job submit -- python -m megaray.pipelines.train CONFIG [key=value ...]``."""
