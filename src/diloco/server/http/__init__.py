"""Everything in the server that speaks HTTP: the FastAPI app, its routes, the dashboard,
uvicorn."""
