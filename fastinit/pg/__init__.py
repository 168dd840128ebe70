"""Process groups: only those a sharding plan needs, created only on their members."""
