"""Init stages run concurrently, the fast batch, and the compiled-artifact cache."""
