"""Each family's kernel space: what its kernels are called, which options and configurations
exist, which ISA each needs (gemm, grouped_conv, disco). Beneath the families, their feature
engines, the DISCO kernels and the dispatcher, which all read it; it imports only the family
protocol (tilecast.core.family)."""
