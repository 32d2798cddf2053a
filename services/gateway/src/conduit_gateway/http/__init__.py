"""The HTTP side: the FastAPI app, its routes, middleware, SSE responses, auth and metrics."""
