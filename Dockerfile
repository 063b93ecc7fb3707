# The pdserve image the manifests in deploy/k8s name (`pdserve:0.1.0`).
#
#   docker build -t pdserve:0.1.0 .                                   # CPU (the default)
#   docker build -t pdserve:0.1.0-cuda --build-arg DEVICE=cuda .      # CUDA torch from PyPI
#
# torch is installed first and pinned, from the CPU index unless DEVICE=cuda, so nothing later
# can pull another build (the Makefile's rule). The entry point is the `pdserve` command; the
# default command serves the embedded tiny model, router and workers in one container.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ARG DEVICE=cpu
ARG TORCH=2.13.0
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="LLM serving with disaggregated prefill and decode"

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PDSERVE_CACHE=/cache
RUN if [ "$DEVICE" = "cpu" ]; then \
        pip install "torch==${TORCH}" --index-url https://download.pytorch.org/whl/cpu; \
    else \
        pip install "torch==${TORCH}"; \
    fi

WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN pip install ".[etcd,grammar]"

# Not root: the workers need no privilege (shared memory and TCP ports above 1024).
RUN useradd --create-home --uid 10001 pdserve && mkdir -p /cache && chown pdserve /cache
USER pdserve
EXPOSE 8000 8100 8101
# The router's and the workers' /health; a worker's is open (unsigned) by design.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s \
    CMD python -c "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('PDSERVE_HEALTH_PORT', '8000') + '/health', timeout=2)"
ENTRYPOINT ["pdserve"]
CMD ["up", "--host", "0.0.0.0", "--port", "8000"]
