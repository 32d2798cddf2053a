"""Code shared by the Conduit services; small and dependency-free, so either service can take it."""
