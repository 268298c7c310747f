# Worker image for docker-compose.yml (users with Docker; CI here has no Docker engine).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY streams streams
COPY replay replay
COPY schemas schemas
COPY app.py .
RUN pip install --no-cache-dir .
ENV SWITCHYARD_DATADIR=/data SWITCHYARD_WEB_BIND=0.0.0.0 SWITCHYARD_WEB_PORT=6066
CMD ["faust", "-A", "app", "worker", "-l", "info"]
