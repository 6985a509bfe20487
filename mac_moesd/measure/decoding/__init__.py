"""The suite's SD decode loop and its drafters: sampling, acceptance, prompt lookup, MTP heads, bookkeeping."""
