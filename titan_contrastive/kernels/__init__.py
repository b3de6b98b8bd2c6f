"""Optional fused kernels (Triton). Importing a kernel module needs `triton`; nothing else imports
them unless asked to (`[loss] kernel = "triton"`)."""
