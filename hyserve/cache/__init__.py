"""KV blocks and recurrent-state slots: the memory that requests own while they run."""
