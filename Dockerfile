# torchrevive's image: the package installed from its wheel (not editable, no test extras), the
# etcd3 client, torch, and examples/ for the Kubernetes example; runs as a non-root user.
#   docker build -t torchrevive .                         # CUDA torch, for GPU clusters
#   docker build -t torchrevive:cpu --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" .
# scripts/check_image_install.sh performs these install steps without a docker engine.

FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent agent
COPY launcher launcher
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
# torch==2.13.0 from PyPI is the CUDA build on Linux x86_64 (it brings the nvidia-* CUDA
# libraries); pass the CPU build's index as above for a CPU image. Installed first and pinned, so
# the package's `torch>=2.13,<2.14` requirement is already met and cannot pull another build.
ARG TORCH_SPEC="torch==2.13.0"
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1
# Unquoted on purpose: TORCH_SPEC may carry pip options such as --index-url.
RUN pip install --no-cache-dir $TORCH_SPEC
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/torchrevive-*.whl)[etcd]" && rm -rf /wheels
# A fixed UID, so Kubernetes' runAsUser/fsGroup can match it; /checkpoints is writable by it for
# a local run (on Kubernetes a volume is mounted there).
RUN groupadd --gid 10001 torchrevive \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/torchrevive torchrevive \
    && mkdir -p /checkpoints \
    && chown 10001:10001 /checkpoints
WORKDIR /opt/torchrevive
COPY examples examples
USER 10001:10001
# Exec form: the agent is PID 1 and receives SIGTERM itself, and forwards it to the workers.
ENTRYPOINT ["torchrevive"]
CMD ["run", "--help"]
