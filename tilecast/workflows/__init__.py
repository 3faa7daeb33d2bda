"""Work that strings stages together: the pipeline over a workdir, the rebenchmark (+ regression), a user's evaluation of the published model, two runs' repeatability."""
