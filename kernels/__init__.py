"""Metal kernel sources (kernels/*.metal), shipped as package data."""
