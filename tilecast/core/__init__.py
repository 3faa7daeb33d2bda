"""The ground floor, importing nothing of tilecast above it: the machine (hardware, device
lock, settings, resources), the record schema (dataset) and the measurement columns it shares
with imported table datasets (columns), statistics, the tuning policy, compiling kernels, a
model artifact's files and kinds, and atomic file writes."""
