"""Real multi-rank runs: a small transformer, rank launching, and the save / re-shard / reload matrix."""
