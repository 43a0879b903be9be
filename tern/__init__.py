"""The server put together: its settings (every flag and TERN_* variable) and the app factory (engine -> FastAPI
with /v1 and the UI). app.py runs it under uvicorn; deploy/ runs it once per Ray replica."""
