"""Developer tools that depend on fastinit (never the reverse)."""
