"""The measurement store (every night's records, kept across runs and machines) and the labels
pooled from its nights: `store` the files, `records` their schema, `nights` what goes in and
what is there, `labels` what training reads out, `drift` the kernels that moved."""
