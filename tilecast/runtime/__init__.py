"""What answers at run time: the dispatcher, the serving loader, the in-process kernels (kernel_library, ops) and the native forest scorer (native)."""
