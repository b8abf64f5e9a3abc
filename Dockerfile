# arserve on an NVIDIA GPU: the build stage compiles arserve with the CUDA
# backend (make CUDA=1) on CUDA 13's devel image and makes the tiny demo
# model; the runtime stage ships the binary, the model and the shared
# libraries it needs on the matching runtime image (cuBLAS included), as a
# non-root user.
#
#   docker build -t arserve .
#   docker run --gpus all -p 8080:8080 arserve
#
# tests/cli/test_dockerfile.sh checks this file's structure (make test).

ARG CUDA_VERSION=13.0.0
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
# Compute capabilities to build for (A100: 80, H100/H200: 90).
ARG CUDA_ARCHS="80 90"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc make libopenblas-dev libcjson-dev libpng-dev libmicrohttpd-dev libjemalloc-dev \
        python3 python3-numpy \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Makefile ./
COPY engine/ engine/
COPY server/ server/
COPY kernels/ kernels/
COPY tools/make_tiny_model.py tools/safetensors_write.py tools/
COPY config/ config/
RUN make -j"$(nproc)" CUDA=1 CUDA_ARCHS="${CUDA_ARCHS}" BUILD=build-cuda all
# The demo model: the tiny random model the tests use (fixed seed); mount a
# real one over /opt/arserve/model, or point --model elsewhere.
RUN python3 tools/make_tiny_model.py --seed 1 --out /opt/arserve/model

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libopenblas0-pthread libcjson1 libpng16-16t64 libmicrohttpd12t64 libjemalloc2 libgomp1 \
        curl \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --create-home --home-dir /home/arserve arserve
COPY --from=build /src/build-cuda/arserve /usr/local/bin/arserve
COPY --from=build /opt/arserve/model /opt/arserve/model
COPY config/arserve.example.json /etc/arserve/arserve.example.json
USER arserve
WORKDIR /home/arserve
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8080/health || exit 1
CMD ["arserve", "serve", "--model", "/opt/arserve/model", "--host", "0.0.0.0", "--port", "8080"]
