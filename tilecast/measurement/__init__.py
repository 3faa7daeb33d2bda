"""Measuring kernels: the protocol every family is timed by (protocol), its candidates side by
side in one process (interleave), the machine's ceilings (probe) and the raw records' log
(rawlog). Above the families, whose kernels it runs; beneath the stages that drive it."""
