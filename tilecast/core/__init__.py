"""The ground floor, importing nothing of tilecast above it: the machine (hardware, device
lock, settings, resources), the record schema (dataset), statistics, the tuning policy,
compiling kernels, a model artifact's files and kinds, and atomic file writes."""
