"""A local OpenAI-compatible server started, driven by many agents, and its SD counters read."""
