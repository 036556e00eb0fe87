"""Process groups, cross-rank agreement and the state that lives between compiled graphs."""
