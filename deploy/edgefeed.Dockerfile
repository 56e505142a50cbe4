# The edgefeed image: router, regional workers, exporter and the connectors CLI.
# Build: docker build -f deploy/edgefeed.Dockerfile -t edgefeed:0.1.0 .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY edgefeed edgefeed
COPY connectors connectors
COPY pipeline pipeline
COPY edge_cache edge_cache
COPY preprocess preprocess
COPY workers workers
COPY monitoring monitoring
COPY examples examples
RUN pip install --no-cache-dir ".[pipeline,preprocess,workers]"
COPY deploy/edgefeed.compose.yaml /etc/edgefeed/edgefeed.yaml
ENV EDGEFEED_SETTINGS=/etc/edgefeed/edgefeed.yaml
USER 65534
ENTRYPOINT ["edgefeed"]
