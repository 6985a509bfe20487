"""KV and recurrent caches: copies, prompt caches rolled back, rollback strategies and their audit."""
