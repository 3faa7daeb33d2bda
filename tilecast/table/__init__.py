"""The table family: measurements someone else took (Kernel Tuner caches, AutoHeuristic data,
CK tile-engine CSVs, any table with a mapping), imported into one dataset directory and
trained, evaluated across devices, published and dispatched like a built-in family."""
