"""The machine: chip, backend, BLAS, unified memory, and the metadata recorded with results."""
