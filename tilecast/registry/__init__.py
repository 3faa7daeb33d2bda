"""The model registry: versions and aliases (api), where they are kept (local, remote, cache) and the promotion gate (gate)."""
