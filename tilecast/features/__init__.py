"""Feature engines, one per family: fixed, named column orders (see feature_spec.json)."""
