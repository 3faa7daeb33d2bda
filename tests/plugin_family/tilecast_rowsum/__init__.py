"""tilecast-rowsum: a row-sum reduction kernel family, registered with tilecast through the
`tilecast.families` entry point (see pyproject.toml); the family is tilecast_rowsum.family."""
