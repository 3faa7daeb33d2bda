"""The pipeline's stages, one module each, in the order a run calls them: build, bench, convert (+ convert_ck), train, evaluate, report."""
