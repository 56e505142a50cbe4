# The edgefeed image: one image for every role (router, regional feature workers,
# model workers, exporter, the connectors CLI), for compose and Kubernetes alike.
# Build: docker build -f deploy/edgefeed.Dockerfile -t edgefeed:0.1.0 .
# The tag is the release (pyproject's version); deploy/k8s pins it the same way,
# and a release pipeline pins the digest (docs/deploy.md).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY edgefeed edgefeed
COPY edgefeed_base edgefeed_base
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
# The regional workers' entity states (pipeline.state_dir): a volume there takes
# this folder's owner, so that the non-root user can write it.
RUN mkdir -p /var/lib/edgefeed/state && chown 65534:65534 /var/lib/edgefeed/state
USER 65534
ENTRYPOINT ["edgefeed"]
