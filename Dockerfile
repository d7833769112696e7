# The kvcache image: every role (coordinator, node, worker, gateway) from one image, installed
# with the README's command, `make install` (a .venv with the project and the default model).
# Build: docker build -t kvcache .   Run: docker run kvcache kvcache coordinator --host 0.0.0.0
FROM python:3.12-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvcache
COPY . .
RUN make install && rm -rf /root/.cache/pip

ENV PATH=/opt/kvcache/.venv/bin:$PATH
# No root needed: the node's --data-dir is a volume the user owns (fsGroup on Kubernetes).
RUN useradd --system --uid 10001 kvcache && mkdir -p /var/lib/kvcache && chown kvcache /var/lib/kvcache
USER 10001
# Coordinator, kvnode gRPC, kvnode data plane, worker, gateway, metrics.
EXPOSE 50050 50051 50052 50061 8000 9100
CMD ["kvcache", "--help"]
