"""Which experts routing activates: traces, counts, the sweep's routing control, the sorted gather."""
