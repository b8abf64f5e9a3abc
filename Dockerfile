# arserve on an NVIDIA GPU: the build stage compiles arserve with the CUDA
# backend (make CUDA=1) on CUDA 13's devel image; the runtime stage ships the
# binary, the shipped demo model (models/shapes) and the shared libraries it
# needs on the matching runtime image (cuBLAS included), as a non-root user.
#
#   docker build -t arserve:latest .
#   docker run --gpus all -p 8080:8080 arserve:latest
#   docker run --gpus all -p 8080:8080 \
#       -v /path/to/model:/opt/arserve/model:ro -e ARSERVE_MODEL=/opt/arserve/model \
#       -e ARSERVE_API_KEY arserve:latest
#
# The first serves the demo model; the second a converted model directory
# (docs/model-format.md) mounted read-only, with the API key exported in
# ARSERVE_API_KEY (deploy/README.md). tests/cli/test_dockerfile.sh checks this
# file's structure, tests/python/test_deploy.py these lines (make test).

ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
# Compute capabilities to build for (A100: 80, H100/H200: 90).
ARG CUDA_ARCHS="80 90"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc make libopenblas-dev libcjson-dev libpng-dev libmicrohttpd-dev libjemalloc-dev libpcre2-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Makefile ./
COPY base/ base/
COPY engine/ engine/
COPY cli/ cli/
COPY server/ server/
COPY kernels/ kernels/
COPY config/ config/
RUN make -j"$(nproc)" CUDA=1 CUDA_ARCHS="${CUDA_ARCHS}" BUILD=build-cuda all

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libopenblas0-pthread libcjson1 libpng16-16t64 libmicrohttpd12t64 libjemalloc2 libgomp1 libpcre2-8-0 \
        curl \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --create-home --home-dir /home/arserve arserve
# arserve finds its shipped model from its own path (../models/shapes), through
# the symlink too; ARSERVE_MODEL or --model picks another.
COPY --from=build /src/build-cuda/arserve /opt/arserve/bin/arserve
COPY models/ /opt/arserve/models/
RUN ln -s /opt/arserve/bin/arserve /usr/local/bin/arserve
COPY config/arserve.example.json /etc/arserve/arserve.example.json
USER arserve
WORKDIR /home/arserve
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8080/health || exit 1
# The image listens on every interface. Without a key anyone who reaches the
# port can use it, and arserve says so at start: give one,
#   export ARSERVE_API_KEY=$(openssl rand -hex 24); docker run -e ARSERVE_API_KEY ...
# or mount a file and add --api-key-file /run/secrets/arserve_key. Clients
# then send 'Authorization: Bearer KEY'. Behind a proxy, add
# --max-connections-per-ip 0 (every request comes from the proxy's address).
CMD ["arserve", "serve", "--host", "0.0.0.0", "--port", "8080"]
