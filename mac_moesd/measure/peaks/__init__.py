"""The chip's peak bandwidth and FLOPS from verified kernels, and the roofline ridge point."""
