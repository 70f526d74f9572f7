# chatpipe:latest, the image the Kubernetes (Volcano) launch runs (params.yaml launch.image):
#
#   docker build -t chatpipe:latest .                       # CPU torch (default)
#   docker build -t chatpipe:cu128 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   python -m chatpipe.launch pretrain --scheduler kubernetes --dryrun   # the Volcano job it runs in
#   docker run --rm chatpipe:latest bwrap --version                  # the sandbox is in the image
#   docker run --rm --security-opt seccomp=unconfined chatpipe:latest \
#       python -c "from chatpipe.sandbox import run_program; print(run_program('print(1)'))"
#
# The repo sits at /workspace (params.yaml launch.workdir); the job mounts artifacts/, checkpoints/
# and mlruns/ there from volumes (launch.volume), so stage outputs and the MLflow store outlive pods.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=1
WORKDIR /workspace
# bubblewrap: the only sandbox model-written code (HumanEval) runs in; without it that eval refuses to run.
# It needs user namespaces at run time: a pod or container whose seccomp profile blocks them
# (Docker's default does) makes the sandbox refuse with bwrap's own message (chatpipe/sandbox.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends git bubblewrap \
    && rm -rf /var/lib/apt/lists/* \
    && bwrap --version

# torch first, from PyTorch's own index: the default index's torch wheel is the multi-GB CUDA build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "torch==2.13.0" --index-url "${TORCH_INDEX}"

# dependencies in their own layer (rebuilt only when pyproject.toml changes), then the code
COPY pyproject.toml README.md ./
RUN mkdir -p chatpipe stages flows && touch chatpipe/__init__.py stages/__init__.py flows/__init__.py \
    && pip install . && pip uninstall -y chatpipe
COPY . .
RUN pip install --no-deps -e . && mkdir -p artifacts checkpoints mlruns logs

CMD ["python", "-m", "chatpipe.cli", "--help"]
