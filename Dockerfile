# torchrevive with torch. The install is scripts/setup.sh, the same step CI runs, so they cannot drift.
FROM python:3.11-slim
WORKDIR /opt/torchrevive
COPY . .
RUN bash scripts/setup.sh
ENV PATH=/opt/torchrevive/.venv/bin:$PATH
# Exec form: the agent is PID 1 and receives SIGTERM itself, and forwards it to the workers.
ENTRYPOINT ["/opt/torchrevive/.venv/bin/torchrevive"]
CMD ["run", "--help"]
